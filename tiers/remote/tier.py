"""Remote tier: blocks shared by many hosts in Valkey/Redis (standalone or cluster).

Keys are `kvstrata:<namespace digest hex>:2.<generation>:<block hash hex>` (`tiers/remote/keys.py`),
so many models share a server and one namespace can be listed or dropped by prefix (SCAN,
never KEYS); a clear changes the namespace's generation, so no reader finds an old block
from then on, and deletes the old ones in bounded, resumable rounds (`tiers/remote/sweep.py`).
Values are self-checking records (`tiers/shared/record.py`); one that fails any check is a
miss and is deleted. Writes are queued and sent by a background thread in pipelined batches, parents
before children (`tiers/remote/writer.py`): a caller that finds the queue full waits for room,
and a write that must be dropped loses only a tail, never a block before kept ones. `flush()`
returns once everything queued so far is on the server. Capacity is the server's
(`maxmemory`, `maxmemory-policy allkeys-lru`).

Every server fault (a dead node, a timeout, OOM/READONLY/CLUSTERDOWN replies, a dropped
connection) is a miss or a dropped write with a counter and a rate-limited warning, never an
exception from a read or a write. Each call has a deadline on its total time
(`tiers/remote/client.py`). Reads and writes keep apart health: a circuit breaker stops one
kind of call for `cooldown_s` after repeated faults of that kind, then tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tiers.base import Occupancy, SweepResult, Tier, TierCounters, TierTraits, check_start
from tiers.changes import ChangeKind
from tiers.codecs import CodecSpec
from tiers.errors import StoreClosedError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.remote.client import CONNECTIONS_PER_NODE, Server, connect
from tiers.remote.keys import Generation, KeyLayout, new_generation
from tiers.remote.recycle import RecordBuffers
from tiers.remote.stream import Landed, Op, ReplyTooLong, command
from tiers.remote.sweep import Walk, sweep, unfinished
from tiers.remote.url import SCHEMES, check_url, identity, redacted
from tiers.remote.writer import Record, WriteQueue
from tiers.shared.forks import renew_in_child
from tiers.shared.ratelimit import RateLimitedWarning
from tiers.shared.record import RecordCodec
from tiers.shared.record_check import ChecksRecords, RecordCheck

logger = logging.getLogger(__name__)

__all__ = ["SCHEMES", "RemoteTier", "SweepResult", "check_url", "connect", "redacted"]

_BATCH_BYTES = 64 << 20  # records per call (a write batch, a chunk of a read), each with its deadline
_WINDOW_BYTES = 1 << 20  # unanswered bytes per connection (see tiers/remote/stream.py)
_REPLY_BYTES = 64  # a small reply (EXISTS, DEL, SET's OK), for deadlines and bounds
_RECORD_SLACK = 1024  # a record's header beyond the block's bytes, at most (for deadlines)
_SCAN_COUNT = 10_000  # slots one SCAN round visits
_RECYCLE_FROM = 64 << 10  # blocks of at least this many bytes are encoded into reused buffers
_HEADER_ROOM = 8 << 10  # a reused buffer's room for the record's header (a longer one: a fresh record)
_IDLE_S = 5.0  # the writer releases the reused buffers after this long without writes


class RemoteTier(ChecksRecords, Tier):
    """Blocks in a Valkey/Redis server or cluster, shared by every store with this namespace.

    Invariant: a value returned is bit-exact with what some store put under its key (the
    record's checksum, key, namespace, layout and token ids are checked) since the last clear
    of its namespace (the generation); anything else is deleted and reported as absent (an
    old generation's blocks are never even read). A round trip moving n bytes must end within
    `timeout_s + n / min_rate_bps` (connect, send and the whole reply), else it is a fault.
    `password` authenticates where the URL has none (the tier reads no environment variable).
    A clear (or a listing) walks the server for at most `clear_budget_s`. Large reads and
    writes run on up to `connections_per_node` connections per server node at once, each key
    always on the same one (`Server.stream`).
    """

    kind = TierKind.REMOTE
    traits = TierTraits(persistent=True, shared=True)

    def __init__(self, url: str, block_shape: tuple[int, ...], dtype: torch.dtype, *, namespace: bytes,
                 verify_tokens: bool = True, ttl_s: int | None = None, timeout_s: float = 0.5,
                 max_pending_bytes: int = 256 << 20, cooldown_s: float = 5.0,
                 min_rate_bps: float = 64 << 20, codec: CodecSpec | None = None, password: str | None = None,
                 clear_budget_s: float = 30.0, connections_per_node: int = CONNECTIONS_PER_NODE) -> None:
        self._server = Server(url, timeout_s=timeout_s, min_rate_bps=min_rate_bps, cooldown_s=cooldown_s,
                              window_bytes=_WINDOW_BYTES, password=password, connections_per_node=connections_per_node)
        self._url = url
        self.reads, self.writes = self._server.reads, self._server.writes
        self._call, self._stream, self._fault = self._server.call, self._server.stream, self._server.fault
        self.codec = RecordCodec(block_shape, dtype, verify_tokens=verify_tokens, namespace=namespace, codec=codec)
        self._keys = KeyLayout(namespace)
        self.clear_budget_s = clear_budget_s
        self._ttl_s = ttl_s
        self._record_bytes = self.codec.block_bytes + _RECORD_SLACK
        self._value_limit = 2 * self._record_bytes + (1 << 16)  # longer values are refused unread
        self.counters = TierCounters()
        self.num_write_drops = self.num_foreign_keys = self.num_clears_incomplete = 0
        self._warn_drop, self._warn_data, self._warn_clear = (RateLimitedWarning(logger) for _ in range(3))
        self._checks = RecordCheck(self.codec, self.counters, self._warn_data, where=f"remote tier {redacted(url)}",
                                   damaged="a damaged record ({}); deleted, a miss")
        self._closed = False
        self._count_lock = threading.Lock()
        self._rx = threading.local()  # each reading thread's record buffer, reused
        renew_in_child(self, "_count_lock")
        self._server.check_policy()  # connects (a cluster client contacts its nodes: a counted fault if down)
        self._gen = Generation(self._keys, lambda fn: self._call(self.reads, "generation", _REPLY_BYTES, fn,
                                                                 2 * _REPLY_BYTES),
                               lambda exc: self._fault(self.reads, "generation", exc))
        self._gen.sync()
        self._recycle = self.codec.block_bytes >= _RECYCLE_FROM  # records are built and received in reused buffers
        self._buffers = RecordBuffers(self.codec.block_bytes + _HEADER_ROOM, max_pending_bytes if self._recycle else 0)
        self._stall_s = 2 * self._server.limit(_BATCH_BYTES) + 1.0  # a batch's longest send, and then some
        self._writes = WriteQueue(self._send, self._dropped, max_pending_bytes=max_pending_bytes,
                                  batch_bytes=_BATCH_BYTES, stall_s=self._stall_s,
                                  on_idle=self._buffers.trim, idle_s=_IDLE_S)

    # -- faults ------------------------------------------------------------------------------
    @property
    def num_errors(self) -> int:
        """Server faults of reads and writes together (`reads.num_errors`, `writes.num_errors`)."""
        return self.reads.num_errors + self.writes.num_errors

    @property
    def identity(self) -> str:
        """The server (or cluster) and database, without credentials or options: instances
        with equal identities share blocks."""
        return identity(self._server.parts)

    @property
    def key_prefix(self) -> bytes:
        """What every server key of this namespace starts with (keys without it are not
        kvstrata's and are never touched)."""
        return self._keys.prefix

    def server_key(self, block_hash: BlockHash) -> bytes:
        """The server key `block_hash` is stored under in the generation in use; changes nothing."""
        return self._keys.key(self._gen.value, block_hash)

    # -- reads -------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return 1 << 40  # the server's maxmemory decides

    def __len__(self) -> int:
        return self.occupancy().num_blocks

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        check_start(start)
        todo = list(block_hashes[start:])
        generation = self._gen.now() if todo else None
        if generation is None:
            return 0
        n = 0

        def on_reply(i: int, reply: Any) -> bool:
            nonlocal n
            if i == 0:
                return self._gen.check(generation, reply)
            n += reply == 1  # an error ends the prefix too
            return bool(reply == 1)

        keys = (self._keys.key(generation, h) for h in todo)
        ops = [self._gen.op(), *(Op(key, command(b"EXISTS", key), 2 * len(key)) for key in keys)]
        self._stream(self.reads, "lookup", _REPLY_BYTES * len(ops), ops, on_reply)
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
        """GET `keys` in one windowed pipeline (lanes if large), each value's payload received
        straight into its `dsts` where that is a contiguous CPU block (`RecordCodec.landing`;
        its prefix and header into a buffer of the thread's), else the whole value into a
        record buffer and copied out once validated; returns how many blocks precede the first
        absent, failed or refused one (a lane stops at its first such, or past another lane's;
        a later block it read, validated or not, is not counted: its `dsts` hold anything)."""
        copied = [False] * len(keys)
        first_miss = [len(keys)]
        damaged: list[BlockHash] = []
        generation = self._gen.now()
        if generation is None:
            return 0

        def missed(i: int) -> bool:
            with self._count_lock:
                first_miss[0] = min(first_miss[0], i)
                return False

        def on_value(i: int, value: Any) -> bool:
            if i == 0:
                return self._gen.check(generation, value) or missed(0)
            i -= 1

            def on_damaged() -> None:
                damaged.append(keys[i].block_hash)

            try:
                if i > first_miss[0]:
                    return False  # past a miss: not counted whatever it holds
                if isinstance(value, ReplyTooLong):  # refused unread (a fault, its connection closed)
                    self._checks.damaged(f"a value claiming {value.claimed} bytes, too long for this layout",
                                         on_damaged)
                if isinstance(value, Landed):
                    ok = self._checks.take_landed(value.head, value.tail, keys[i], dsts[i], on_damaged)
                else:
                    ok = isinstance(value, memoryview) and self._checks.take(value, keys[i], dsts[i], on_damaged)
                if not ok:
                    return missed(i)  # absent, refused by the server, or failed its checks
                copied[i] = True
                return True
            finally:
                if isinstance(value, (memoryview, Landed)):  # a reused buffer back (this thread's own is not taken)
                    self._buffers.give((value.head if isinstance(value, Landed) else value).obj)

        ops = [self._gen.op(), *(Op(key, command(b"GET", key), self._record_bytes, bulk=True, limit=self._value_limit,
                                    tail=self.codec.landing(dst))
                                 for key, dst in zip((self._keys.key(generation, k.block_hash) for k in keys), dsts))]
        self._stream(self.reads, "read", self._record_bytes * len(keys) + _REPLY_BYTES, ops, on_value,
                     self._buffer_for, head=1)
        if damaged:
            self.discard(damaged)
        return copied.index(False) if False in copied else len(keys)

    def _buffer_for(self, size: int) -> memoryview:
        """`size` bytes (at most `_value_limit`: longer values are refused unread) of a
        reused record buffer (faulted in already; `on_value` gives it back), where blocks are
        large and it fits, else (or for a value's head, its payload landing apart) of this
        thread's own."""
        if self._recycle and _HEADER_ROOM < size <= self._buffers.size:
            return memoryview(self._buffers.take())[:size]
        buf: bytearray | None = getattr(self._rx, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._rx.buf = bytearray(max(size, _HEADER_ROOM if self._recycle else self._record_bytes))
        return memoryview(buf)[:size]

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
        generation = self._gen.now()
        if generation is None:
            self._dropped(len(keys), "the namespace's generation is not known: the server did not tell")
            return 0
        order = range(len(keys) - 1, -1, -1)
        records = ((self._keys.key(generation, keys[i].block_hash), self._encode(keys[i], srcs[i]), keys[i])
                   for i in order)
        return self._writes.put(records, len(keys))

    def _encode(self, key: BlockKey, src: torch.Tensor) -> memoryview:
        """The record of one block, in a reused buffer where blocks are large (its page faults
        cost more than the copy: `tiers/remote/recycle.py`), else a fresh one."""
        if self._recycle:
            buf = self._buffers.take()
            size = self.codec.encode_into(key, src, memoryview(buf))
            if size is not None:
                return memoryview(buf)[:size]
        return memoryview(self.codec.encode(key, src))

    def _dropped(self, num: int, why: str) -> None:
        with self._count_lock:  # the caller's thread and the writer's
            self.num_write_drops += num
        if num:
            self._warn_drop(f"remote tier {redacted(self._url)}: {num} block writes dropped ({why})")

    def _send(self, batch: list[Record]) -> list[bool]:
        """SET the batch's records in one windowed pipeline (lanes by key if large), each lane
        after a GET of the generation; whether each was stored under the generation in use (the server's). A batch of
        another generation (a clear since its records were made, or the key lost) stops: what
        was sent of it is unreachable, and it counts as dropped."""
        size = sum(r.value.nbytes for r in batch)
        ttl: tuple[bytes | int, ...] = (b"EX", self._ttl_s) if self._ttl_s else ()
        parsed = [self._keys.parse(r.key) for r in batch]
        ops = [self._gen.op(), *(Op(r.key, command(b"SET", r.key, r.value, *ttl), r.value.nbytes) for r in batch)]
        stored = [False] * len(batch)

        def on_reply(i: int, reply: Any) -> bool:
            if i == 0:
                return self._gen.check(parsed[0][0], reply)
            stored[i - 1] = reply == b"OK" and parsed[i - 1][0] == parsed[0][0]
            return True

        sent = self._stream(self.writes, "write", size + _REPLY_BYTES, ops, on_reply, head=1)
        for r in batch:  # sent or not, the socket holds no reference to them now
            self._buffers.give(r.value.obj)
        if not sent:
            return [False] * len(batch)
        self._record(ChangeKind.ENTERED, [r.block for r, ok in zip(batch, stored) if ok])
        return stored

    def held_hashes(self, limit: int = 1_000_000) -> Iterator[BlockHash]:
        """This namespace's blocks of the generation in use on the server (SCAN by prefix in
        bounded rounds, at most `limit`, for at most `clear_budget_s`); what was read before a
        fault (counted) otherwise. Keys under the prefix that are not kvstrata's are skipped
        and counted in `num_foreign_keys`."""
        self._check_open()
        found: list[BlockHash] = []
        foreign = 0
        for _, keys in Walk(self._server.caller(self.reads), self._keys.prefix + b"*", count=_SCAN_COUNT,
                            budget_s=self.clear_budget_s):
            hashes, others = self._keys.blocks_of(keys, self._gen.value)
            found += hashes
            foreign += others
            if len(found) >= limit:
                break
        if foreign:
            self.num_foreign_keys += foreign
            self._warn_data(f"remote tier {redacted(self._url)}: {foreign} keys under this namespace's prefix "
                            "are not kvstrata's blocks; skipped")
        return iter(found[:limit])

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
        keys = [self.server_key(h) for h in block_hashes]
        # A write of these keys still queued would land after the delete: taken off, or waited for.
        cancelled = self._writes.cancel(keys, self._stall_s)
        for r in cancelled.records:
            self._buffers.give(r.value.obj)
        if not cancelled.settled:
            self._warn_drop(f"remote tier {redacted(self._url)}: a write of a block being deleted was still being "
                            "sent after the wait; it may land after the delete")
        deleted = self._server.pipelined(self.writes, "delete", _REPLY_BYTES * len(block_hashes),
                                         lambda pipe: [pipe.delete(k) for k in keys]) or []
        gone = [h for h, n in zip(block_hashes, deleted) if n == 1]
        self._record(ChangeKind.LEFT, gone)
        return len(gone)

    def clear(self, *, all_namespaces: bool = False) -> None:
        """`sweep` (whose result says whether it finished)."""
        self.sweep(all_namespaces=all_namespaces)

    def sweep(self, *, all_namespaces: bool = False, budget_s: float | None = None) -> SweepResult:
        """Clear this namespace: a fresh generation first (from then on no reader finds its
        old blocks), then delete the old blocks (with `all_namespaces`, every kvstrata key on
        the server but this namespace's new generation) in resumable SCAN rounds, for at most
        `budget_s` (default `clear_budget_s`). Returns how many keys went and whether that was
        all; an incomplete clear (out of time, a fault, or no new generation) is counted in
        `num_clears_incomplete`, with a rate-limited warning."""
        self._check_open()
        self.flush()
        generation, key = new_generation(), self._keys.generation_key
        renewed = self._call(self.writes, "clear (a new generation)", _REPLY_BYTES,
                             lambda c: c.set(key, generation), _REPLY_BYTES) is not None
        if renewed:
            self._gen.adopt(generation)
        pattern = b"kvstrata:*" if all_namespaces else self._keys.prefix + b"*"
        doomed = self._keys.is_swept if all_namespaces else self._keys.is_stale
        swept = sweep(self._server.caller(self.writes), pattern, lambda k: doomed(k, generation), count=_SCAN_COUNT,
                      budget_s=self.clear_budget_s if budget_s is None else budget_s)
        result = SweepResult(swept.num_deleted, swept.complete and renewed)
        if not result.complete:
            self.num_clears_incomplete += 1
            self._warn_clear(f"remote tier {redacted(self._url)}: {unfinished(result, renewed, all_namespaces)}")
        return result

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Flush for up to 10 s, drop (counted) what is left, then release the connections."""
        if self._closed:
            return
        self._writes.close(timeout_s=10.0, join_s=self._server.limit(_BATCH_BYTES) + 1.0)
        self._closed = True
        self._server.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"remote tier {redacted(self._url)} is closed")

    def check_integrity(self) -> None:
        self._writes.check_integrity()

    def occupancy(self) -> Occupancy:
        """The server's memory (`used_memory` of `maxmemory`); blocks are not counted (0)."""
        return Occupancy(0, self.capacity_blocks, *self._server.memory())
