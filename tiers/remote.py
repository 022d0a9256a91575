"""Remote tier: blocks shared by many hosts in Valkey/Redis (standalone or cluster).

Keys are `kvstrata:<namespace digest hex>:<block hash hex>`, so many models share a server
and one namespace can be listed or dropped by prefix (SCAN, never KEYS). Values are the disk
tier's self-checking records (`tiers/lmdb_record.py`); one that fails any check is a miss and
is deleted. Writes are queued and sent by a background thread in pipelined batches, parents
before children (`tiers/remote_writer.py`): a caller that finds the queue full waits for room,
and a write that must be dropped loses only a tail, never a block before kept ones. `flush()`
returns once everything queued so far is on the server. Capacity is the server's
(`maxmemory`, `maxmemory-policy allkeys-lru`).

Every server fault (a dead node, a timeout, OOM/READONLY/CLUSTERDOWN replies, a dropped
connection) is a miss or a dropped write with a counter and a rate-limited warning, never an
exception from a read or a write. Each call has a deadline on its total time
(`tiers/remote_client.py`). Reads and writes keep apart health: a circuit breaker stops one
kind of call for `cooldown_s` after repeated faults of that kind, then tries again.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tiers.base import BlockHash, BlockKey, Occupancy, Tier, TierCounters, TierKind, TierTraits
from tiers.codecs import CodecSpec
from tiers.errors import CorruptRecordError, StoreClosedError, UnverifiableRecordError
from tiers.lmdb_record import RecordCodec
from tiers.remote_client import Health, RateLimitedWarning, connect, deadline
from tiers.remote_stream import Op, ReplyTooLong, Streams, command
from tiers.remote_url import SCHEMES, check_url, identity, parse, redacted, scrub
from tiers.remote_writer import Record, WriteQueue

__all__ = ["SCHEMES", "RemoteTier", "check_url", "connect", "redacted"]

_BATCH_BYTES = 64 << 20  # records per call (a write batch, a chunk of a read), each with its deadline
_WINDOW_BYTES = 1 << 20  # unanswered bytes per connection (see tiers/remote_stream.py)
_REPLY_BYTES = 64  # a small reply (EXISTS, DEL, SET's OK), for deadlines and bounds
_RECORD_SLACK = 1024  # a record's header beyond the block's bytes, at most (for deadlines)
_REPLY_SLACK = 1 << 20  # what a call may receive beyond its replies (a handshake, a cluster's slot map)
_INFO_BYTES = 1 << 20  # INFO memory of every node
_KEY_BYTES = 1024  # a key SCAN returns under a namespace's prefix, at most (longer ones end the call)


class RemoteTier(Tier):
    """Blocks in a Valkey/Redis server or cluster, shared by every store with this namespace.

    Invariant: a value returned is bit-exact with what some store put under its key (the
    record's checksum, key, namespace, layout and token ids are checked); anything else is
    deleted and reported as absent. A round trip moving n bytes must end within
    `timeout_s + n / min_rate_bps` (connect, send and the whole reply), else it is a fault.
    `password` authenticates where the URL has none (the tier reads no environment variable).
    """

    kind = TierKind.REMOTE
    traits = TierTraits(persistent=True, shared=True)

    def __init__(self, url: str, block_shape: tuple[int, ...], dtype: torch.dtype, *, namespace: bytes,
                 verify_tokens: bool = True, ttl_s: int | None = None, timeout_s: float = 0.5,
                 max_pending_bytes: int = 256 << 20, cooldown_s: float = 5.0,
                 min_rate_bps: float = 64 << 20, codec: CodecSpec | None = None,
                 password: str | None = None) -> None:
        self._parts = parse(url)
        self._url = url
        self._password = password  # used where the URL has none
        self._secrets = self._parts.secrets + [s for s in (password,) if s]
        self.codec = RecordCodec(block_shape, dtype, verify_tokens=verify_tokens, namespace=namespace, codec=codec)
        self._prefix = b"kvstrata:" + namespace.hex()[:32].encode() + b":"
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._min_rate_bps = min_rate_bps
        self._record_bytes = self.codec.block_bytes + _RECORD_SLACK
        self._value_limit = 2 * self._record_bytes + (1 << 16)  # longer values are refused unread
        self.counters = TierCounters()
        self.num_write_drops = self.num_unverifiable = self.num_foreign_keys = 0
        self.reads, self.writes = Health("read", cooldown_s), Health("write", cooldown_s)
        self._warn_drop, self._warn_data = RateLimitedWarning(), RateLimitedWarning()
        self._closed = False
        self._client_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._client: Any = None
        self._streams: Streams | None = None
        self._rx = threading.local()  # each reading thread's record buffer, reused
        self._check_policy()  # connects (a cluster client contacts its nodes: a counted fault if down)
        self._writes = WriteQueue(self._send, self._dropped, max_pending_bytes=max_pending_bytes,
                                  batch_bytes=_BATCH_BYTES, stall_s=2 * self._limit(_BATCH_BYTES) + 1.0)

    # -- faults ------------------------------------------------------------------------------
    @property
    def num_errors(self) -> int:
        """Server faults of reads and writes together (`reads.num_errors`, `writes.num_errors`)."""
        return self.reads.num_errors + self.writes.num_errors

    def _limit(self, nbytes: int) -> float:
        """The deadline of a round trip moving `nbytes`."""
        return self._timeout_s + nbytes / self._min_rate_bps

    def _connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                with deadline(self._timeout_s, _REPLY_SLACK):
                    self._client = connect(self._url, self._timeout_s, self._parts, self._password)
                self._streams = Streams(self._client, _WINDOW_BYTES)
            return self._client

    def _stream(self, health: Health, what: str, nbytes: int, ops: list[Op], on_reply: Callable[[int, Any], bool],
                buffer_for: Callable[[int], memoryview | None] | None = None) -> bool:
        """Run `ops` as a windowed pipeline (`tiers/remote_stream.py`) within the deadline for
        `nbytes`, passing each reply to `on_reply` until it returns False; False if the call
        failed as a whole. Errors (refused commands, a lost connection, a reply longer than
        its `Op.limit`) are one fault of `health` per call."""
        replies = 2 * sum(op.limit for op in ops)  # a cluster may send a call twice
        return self._call(health, what, nbytes, lambda _: self._streams.run(  # type: ignore[union-attr]
            ops, on_reply, buffer_for), replies) is not None

    def _call(self, health: Health, what: str, nbytes: int, fn: Callable[[Any], Any], reply_bytes: int) -> Any:
        """`fn(client)` within the deadline for `nbytes`, receiving at most `reply_bytes` (and
        `_REPLY_SLACK`); None if the server fails, the deadline passes, it sends more, or
        `health`'s breaker is open. A list of replies with a command the server refused (its
        exception in its place) is returned as is. Each fault is counted in `health`, with a
        rate-limited warning."""
        if not health.available():
            return None
        try:
            with deadline(self._limit(nbytes), reply_bytes + _REPLY_SLACK):
                result = fn(self._connect())
        except Exception as exc:  # every server fault is a miss or a dropped write
            self._fault(health, what, exc)
            return None
        refused = [r for r in result if isinstance(r, Exception)] if isinstance(result, list) else []
        if refused:  # e.g. OOM from a full noeviction server
            self._fault(health, f"{what} ({len(refused)} of {len(result)} commands)", refused[0])
        else:
            health.ok()
        return result

    def _fault(self, health: Health, what: str, exc: BaseException) -> None:
        health.fault(f"remote tier {redacted(self._url)}: {what} failed "
                     f"({type(exc).__name__}: {scrub(str(exc), self._secrets)}); treated as a miss")

    def _pipelined(self, health: Health, what: str, nbytes: int, commands: Callable[[Any], object]) -> list[Any] | None:
        """The replies to the commands `commands(pipe)` queues, in one round trip (None: a fault).
        A command the server refused has its exception in its place."""
        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            commands(pipe)
            return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

        replies: list[Any] | None = self._call(health, what, nbytes, run, nbytes)
        return replies

    def _check_policy(self) -> None:
        policy = self._call(self.reads, "CONFIG GET maxmemory-policy", _REPLY_BYTES,
                            lambda c: c.config_get("maxmemory-policy"), _REPLY_BYTES)
        values = list(policy.values()) if isinstance(policy, dict) else []
        flat = [v for v in values if isinstance(v, (str, bytes))] or [
            x for v in values if isinstance(v, dict) for x in v.values()]
        if any((p.decode() if isinstance(p, bytes) else p) == "noeviction" for p in flat):
            self.writes.warn(f"remote tier {redacted(self._url)} has maxmemory-policy noeviction: writes fail "
                             "once it is full; set maxmemory-policy allkeys-lru")

    @property
    def identity(self) -> str:
        """The server (or cluster) and database, without credentials or options: instances
        with equal identities share blocks."""
        return identity(self._parts)

    @property
    def key_prefix(self) -> bytes:
        """What every server key of this namespace starts with (keys without it are not
        kvstrata's and are never touched)."""
        return self._prefix

    def server_key(self, block_hash: BlockHash) -> bytes:
        """The server key `block_hash` is stored under; changes nothing."""
        return self._prefix + bytes(block_hash).hex().encode()

    # -- reads -------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return 1 << 40  # the server's maxmemory decides

    def __len__(self) -> int:
        return self.occupancy().num_blocks

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        todo = list(block_hashes[start:])
        if not todo:
            return 0
        n = 0

        def on_reply(i: int, reply: Any) -> bool:
            nonlocal n
            n += reply == 1  # an error ends the prefix too
            return bool(reply == 1)

        ops = [Op(key, command(b"EXISTS", key), 2 * len(key)) for key in map(self.server_key, todo)]
        self._stream(self.reads, "lookup", _REPLY_BYTES * len(todo), ops, on_reply)
        return n

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        per_chunk = max(1, _BATCH_BYTES // self._record_bytes)
        n = 0
        for start in range(0, len(keys), per_chunk):  # one call per chunk, each with its deadline
            chunk = keys[start : start + per_chunk]
            got = self._read(chunk, dsts[start : start + len(chunk)])
            n += got
            if got < len(chunk):
                break
        return n

    def _read(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        """GET `keys` in one windowed pipeline, each value received into this thread's record
        buffer, validated and copied into its `dsts`; stop at the first that is absent, fails
        or was refused (a fault). Returns how many were copied."""
        n = 0
        damaged: list[BlockHash] = []

        def on_value(i: int, value: Any) -> bool:
            nonlocal n
            if isinstance(value, ReplyTooLong):  # refused unread (a fault, its connection closed)
                self._damaged(f"a value claiming {value.claimed} bytes, too long for this layout")
                damaged.append(keys[i].block_hash)
            if not isinstance(value, memoryview):
                return False  # absent, or the server refused this GET
            if not self._take(keys[i], dsts[i], value, damaged):
                return False
            n += 1
            return True

        ops = [Op(key, command(b"GET", key), self._record_bytes, bulk=True, limit=self._value_limit)
               for key in (self.server_key(k.block_hash) for k in keys)]
        self._stream(self.reads, "read", self._record_bytes * len(keys), ops, on_value, self._buffer_for)
        if damaged:
            self.discard(damaged)
        return n

    def _buffer_for(self, size: int) -> memoryview:
        """This thread's record buffer, `size` bytes of it (at most `_value_limit`: the
        reader refuses longer values unread)."""
        buf: bytearray | None = getattr(self._rx, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._rx.buf = bytearray(max(size, self._record_bytes))
        return memoryview(buf)[:size]

    def _take(self, key: BlockKey, dst: torch.Tensor, value: memoryview, damaged: list[BlockHash]) -> bool:
        """Validate one value as `key`'s record and copy its payload into `dst`; False (a
        counted, warned miss) if it fails; a damaged record's hash goes into `damaged`, to be
        deleted (an unverifiable one stays)."""
        try:
            self.codec.copy_out(self.codec.decode(value, key), dst)
        except UnverifiableRecordError as exc:
            self.num_unverifiable += 1
            self._warn_data(f"remote tier {redacted(self._url)}: {exc}; a miss")
            return False
        except CorruptRecordError as exc:
            self._damaged(str(exc))
            damaged.append(key.block_hash)
            return False
        return True

    def _damaged(self, why: str) -> None:
        self.counters.num_corrupt += 1
        self._warn_data(f"remote tier {redacted(self._url)}: a damaged record ({why}); deleted, a miss")

    # -- writes ------------------------------------------------------------------------------
    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Queue the records, parents first (the reverse of the eviction order given), for the
        background writer, waiting for room in the queue (see `WriteQueue.put`). With the
        writes' breaker open nothing is encoded: every block is a counted drop."""
        if not keys:
            return 0
        if not self.writes.available():
            self._dropped(len(keys), "writes are paused after repeated faults")
            return 0
        order = range(len(keys) - 1, -1, -1)
        records = ((self.server_key(keys[i].block_hash), memoryview(self.codec.encode(keys[i], srcs[i])))
                   for i in order)
        return self._writes.put(records, len(keys))

    def _dropped(self, num: int, why: str) -> None:
        with self._count_lock:  # the caller's thread and the writer's
            self.num_write_drops += num
        if num:
            self._warn_drop(f"remote tier {redacted(self._url)}: {num} block writes dropped ({why})")

    def _send(self, batch: list[Record]) -> list[bool]:
        """SET the batch's records in one windowed pipeline; whether each was stored."""
        size = sum(r.value.nbytes for r in batch)
        ttl: tuple[bytes | int, ...] = (b"EX", self._ttl_s) if self._ttl_s else ()
        ops = [Op(r.key, command(b"SET", r.key, r.value, *ttl), r.value.nbytes) for r in batch]
        stored = [False] * len(batch)

        def on_reply(i: int, reply: Any) -> bool:
            stored[i] = reply == b"OK"
            return True

        if not self._stream(self.writes, "write", size, ops, on_reply):
            return [False] * len(batch)
        self._announce(True, [self._hash_of(r.key) for r, ok in zip(batch, stored) if ok])
        return stored

    def _hash_of(self, key: bytes) -> BlockHash:
        return BlockHash(bytes.fromhex(key[len(self._prefix):].decode()))

    def held_hashes(self, limit: int = 1_000_000) -> Iterator[BlockHash]:
        """This namespace's keys on the server (SCAN by prefix, at most `limit`); what was
        read before a fault (counted) otherwise. Keys that are not a block hash are skipped."""
        self._check_open()
        found: list[BlockHash] = []

        def scan(client: Any) -> None:
            for key in client.scan_iter(match=self._prefix + b"*", count=1000):
                try:
                    found.append(self._hash_of(key))
                except ValueError:  # not written by kvstrata
                    self.num_foreign_keys += 1
                if len(found) >= limit:
                    break

        foreign = self.num_foreign_keys
        self._call(self.reads, "scan", _REPLY_BYTES * limit + _BATCH_BYTES, scan, _KEY_BYTES * limit)
        if self.num_foreign_keys > foreign:
            self._warn_data(f"remote tier {redacted(self._url)}: {self.num_foreign_keys - foreign} keys under "
                            f"this namespace's prefix are not kvstrata's blocks; skipped")
        return iter(found)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every write queued so far was sent (or dropped for a fault); False if
        `timeout_s` passed first."""
        return self._writes.flush(timeout_s)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Nothing: the server's LRU sees every read."""

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        if not block_hashes:
            return 0
        deleted = self._pipelined(self.writes, "delete", _REPLY_BYTES * len(block_hashes),
                                  lambda pipe: [pipe.delete(self.server_key(h)) for h in block_hashes]) or []
        gone = [h for h, n in zip(block_hashes, deleted) if n == 1]
        self._announce(False, gone)
        return len(gone)

    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete this namespace's keys (SCAN by prefix); with `all_namespaces`, every
        `kvstrata:` key on the server. A fault (counted) leaves the rest."""
        self._check_open()
        self.flush()
        pattern = b"kvstrata:*" if all_namespaces else self._prefix + b"*"
        with contextlib.suppress(StoreClosedError):
            while True:  # never KEYS on a live server; each round of SCAN + DEL has its deadline
                keys = self._call(self.writes, "clear", _BATCH_BYTES,
                                  lambda c: list(itertools.islice(c.scan_iter(match=pattern, count=1000), 1000)),
                                  _KEY_BYTES * 1000)
                if not keys or not self._delete(keys):
                    return

    def _delete(self, keys: list[bytes]) -> bool:
        """DEL `keys` (a cluster client splits them by slot); False on a fault."""
        return self._call(self.writes, "clear", _REPLY_BYTES * len(keys), lambda c: c.delete(*keys),
                          _REPLY_BYTES * len(keys)) is not None

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Flush for up to 10 s, drop (counted) what is left, then release the connections."""
        if self._closed:
            return
        self._writes.close(timeout_s=10.0, join_s=self._limit(_BATCH_BYTES) + 1.0)
        self._closed = True
        with contextlib.suppress(Exception):  # closing a dead connection
            if self._client is not None:
                self._client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"remote tier {redacted(self._url)} is closed")

    def check_integrity(self) -> None:
        self._writes.check_integrity()

    def occupancy(self) -> Occupancy:
        """The server's memory (`used_memory` of `maxmemory`); blocks are not counted (0)."""
        info = self._call(self.reads, "INFO memory", _INFO_BYTES, lambda c: c.info("memory"), _INFO_BYTES)
        if isinstance(info, dict) and "used_memory" not in info:  # a cluster: per node
            info = {k: sum(int(v.get(k, 0)) for v in info.values() if isinstance(v, dict))
                    for k in ("used_memory", "maxmemory")}
        info = info if isinstance(info, dict) else {}
        return Occupancy(0, self.capacity_blocks, int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))
