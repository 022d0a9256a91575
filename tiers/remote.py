"""Remote tier: blocks shared by many hosts in Valkey/Redis (standalone or cluster).

Keys are `kvstrata:<namespace digest hex>:<block hash hex>`, so many models share a server
and one namespace can be listed or dropped by prefix (SCAN, never KEYS). Values are the disk
tier's self-checking records (`tiers/lmdb_record.py`); one that fails any check is a miss and
is deleted. Writes are queued and sent by a background thread in pipelined batches, off the
caller's path; `flush()` returns once everything queued so far is on the server. Capacity is
the server's (`maxmemory`, `maxmemory-policy allkeys-lru`). Every server fault (a dead node,
a timeout, OOM/READONLY/CLUSTERDOWN replies, a dropped connection) is a miss or a skipped
write with a counter and a rate-limited warning, never an exception from a read or a write:
timeouts are bounded, and a circuit breaker stops trying for `cooldown_s` after repeated
failures, then tries again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tiers.base import BlockHash, BlockKey, Occupancy, Tier, TierCounters, TierKind, TierTraits
from tiers.errors import ConfigError, CorruptRecordError, StoreClosedError
from tiers.lmdb_record import RecordCodec, UnverifiableRecordError

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
PASSWORD_ENV = "KVSTRATA_REMOTE_PASSWORD"
_FAILURES_TO_OPEN = 3  # consecutive failures that open the circuit breaker
_WARN_EVERY_S = 10.0
_BATCH_BYTES = 64 << 20  # records per pipelined write (one round trip)


def redacted(url: str) -> str:
    """`url` with any password replaced by `***` (for messages and logs)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_url(url: object) -> str:
    """`url` if it names a server kvstrata can use, else `ConfigError` (password redacted)."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"remote_url must be a URL such as redis://host:6379, got {url!r}")
    scheme = url.split("://", 1)[0]
    if scheme not in SCHEMES:
        raise ConfigError(f"remote_url scheme {scheme!r} is not one of {', '.join(SCHEMES)}: {redacted(url)}")
    if scheme != "unix" and not urllib.parse.urlsplit(url.replace("+cluster", "")).hostname:
        raise ConfigError(f"remote_url names no host: {redacted(url)}")
    return url


def connect(url: str, timeout_s: float) -> Any:
    """A redis-py client (`Redis` or `RedisCluster`) for `url`; the password comes from the
    URL or `KVSTRATA_REMOTE_PASSWORD`."""
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    password = os.environ.get(PASSWORD_ENV) or None
    # Blocks are large: read in 1 MiB chunks (a socket with a timeout polls before each read).
    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                              "socket_read_size": 1 << 20}
    scheme = url.split("://", 1)[0]
    if scheme.endswith("+cluster"):
        parts = urllib.parse.urlsplit(url.replace("+cluster", ""))
        hosts = parts.netloc.rsplit("@", 1)[-1].split(",")
        nodes = [ClusterNode(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1]) if ":" in h else 6379)  # type: ignore[no-untyped-call]  # redis-py's ClusterNode is unannotated
                 for h in hosts]
        return RedisCluster(startup_nodes=nodes, username=parts.username or None,
                            password=parts.password or password, ssl=scheme.startswith("rediss"),
                            require_full_coverage=False, retry=Retry(NoBackoff(), 1), **common)
    client = redis.Redis.from_url(url, **common)
    if password and not client.connection_pool.connection_kwargs.get("password"):
        client.connection_pool.connection_kwargs["password"] = password
    return client


class RemoteTier(Tier):
    """Blocks in a Valkey/Redis server or cluster, shared by every store with this namespace.

    Invariant: a value returned is bit-exact with what some store put under its key (the
    record's checksum, key, namespace, layout and token ids are checked); anything else is
    deleted and reported as absent.
    """

    kind = TierKind.REMOTE
    traits = TierTraits(persistent=True, shared=True)

    def __init__(self, url: str, block_shape: tuple[int, ...], dtype: torch.dtype, *, namespace: bytes,
                 verify_tokens: bool = True, ttl_s: int | None = None, timeout_s: float = 0.5,
                 max_pending_bytes: int = 256 << 20, cooldown_s: float = 5.0) -> None:
        self._url = check_url(url)
        self.codec = RecordCodec(block_shape, dtype, verify_tokens=verify_tokens, namespace=namespace)
        self._prefix = b"kvstrata:" + namespace.hex()[:32].encode() + b":"
        self._ttl_s = ttl_s
        self._max_pending_bytes = max_pending_bytes
        self._cooldown_s = cooldown_s
        self.counters = TierCounters()
        self.num_errors = self.num_write_drops = self.num_unverifiable = 0
        self._failures = 0
        self._open_until = 0.0
        self._last_warning = 0.0
        self._closed = False
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, memoryview]] = deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._client = connect(url, timeout_s)
        self._check_policy()
        self._writer = threading.Thread(target=self._write_loop, name="kvstrata-remote-writer", daemon=True)
        self._writer.start()

    # -- faults ------------------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._open_until

    def _fault(self, what: str, exc: BaseException) -> None:
        """Count a server fault, warn at most every few seconds, open the breaker if repeated."""
        self.num_errors += 1
        self._failures += 1
        if self._failures >= _FAILURES_TO_OPEN:
            self._open_until = time.monotonic() + self._cooldown_s
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning("kvstrata: remote tier %s: %s failed (%s: %s); treated as a miss", redacted(self._url),
                           what, type(exc).__name__, exc)

    def _ok(self) -> None:
        self._failures = 0

    def _check_policy(self) -> None:
        try:
            policy = self._client.config_get("maxmemory-policy")
        except Exception:
            return
        values = list(policy.values()) if isinstance(policy, dict) else []
        flat = [v for v in values if isinstance(v, (str, bytes))] or [
            x for v in values if isinstance(v, dict) for x in v.values()]
        if any((p.decode() if isinstance(p, bytes) else p) == "noeviction" for p in flat):
            logger.warning("kvstrata: remote tier %s has maxmemory-policy noeviction: writes fail once it is full; "
                           "set maxmemory-policy allkeys-lru", redacted(self._url))

    @property
    def identity(self) -> str:
        """The server's URL without credentials: instances naming the same one share blocks."""
        return redacted(self._url)

    def _key(self, block_hash: BlockHash) -> bytes:
        return self._prefix + bytes(block_hash).hex().encode()

    def _pipelined(self, what: str, commands: Callable[[Any], object]) -> list[Any] | None:
        """Run the commands `commands(pipe)` queues in one round trip; None (a counted,
        rate-limited fault) if the server fails or the breaker is open."""
        if not self._available():
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            commands(pipe)
            replies: list[Any] = pipe.execute()
        except Exception as exc:  # every server fault is a miss or a skipped write
            self._fault(what, exc)
            return None
        self._ok()
        return replies

    # -- reads -------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return 1 << 40  # the server's maxmemory decides

    def __len__(self) -> int:
        return self.occupancy().num_blocks

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        todo = list(block_hashes[start:])
        found = self._pipelined("lookup", lambda pipe: [pipe.exists(self._key(h)) for h in todo]) if todo else None
        if found is None:
            return 0
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        if not keys:
            return 0
        values = self._pipelined("read", lambda pipe: [pipe.get(self._key(k.block_hash)) for k in keys])
        if values is None:
            return 0
        n = 0
        for key, dst, value in zip(keys, dsts, values):
            if value is None:
                break
            try:
                payload = self.codec.decode(value, key)
            except UnverifiableRecordError:
                self.num_unverifiable += 1
                break
            except CorruptRecordError:
                self.counters.num_corrupt += 1
                self.discard([key.block_hash])
                break
            self.codec.copy_out(payload, dst)
            n += 1
        return n

    # -- writes ------------------------------------------------------------------------------
    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Queue the records for the background writer; blocks beyond `max_pending_bytes` of
        queued records are dropped (counted): the remote tier is a cache."""
        # memoryview: redis-py sends it as is (a bytes() copy would double the encode's cost).
        records = [(self._key(k.block_hash), memoryview(self.codec.encode(k, s))) for k, s in zip(keys, srcs)]
        queued = 0
        with self._cond:
            for key, value in records:
                if self._queued_bytes + value.nbytes > self._max_pending_bytes:
                    self.num_write_drops += 1
                    continue
                self._queue.append((key, value))
                self._queued_bytes += value.nbytes
                queued += 1
            self._cond.notify_all()
        return queued

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                batch, size = [], 0
                while self._queue and size < _BATCH_BYTES:
                    key, value = self._queue.popleft()
                    batch.append((key, value))
                    size += value.nbytes
                self._queued_bytes -= size
                self._in_flight = len(batch)
            self._send(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

    def _send(self, batch: list[tuple[bytes, memoryview]]) -> None:
        if self._pipelined("write", lambda pipe: [pipe.set(k, v, ex=self._ttl_s) for k, v in batch]) is None:
            self.num_write_drops += len(batch)
        else:
            self._announce(True, [self._hash_of(k) for k, _ in batch])

    def _hash_of(self, key: bytes) -> BlockHash:
        return BlockHash(bytes.fromhex(key[len(self._prefix):].decode()))

    def held_hashes(self, limit: int = 1_000_000) -> Iterator[BlockHash]:
        """This namespace's keys on the server (SCAN by prefix, at most `limit`); what was
        read before a fault (counted) otherwise."""
        self._check_open()
        found: list[BlockHash] = []
        if not self._available():
            return iter(found)
        try:
            for key in self._client.scan_iter(match=self._prefix + b"*", count=1000):
                found.append(self._hash_of(key))
                if len(found) >= limit:
                    break
        except Exception as exc:
            self._fault("scan", exc)
        return iter(found)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every write queued so far was sent (or dropped for a fault); False if
        `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Nothing: the server's LRU sees every read."""

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        if not block_hashes:
            return 0
        deleted = self._pipelined("delete", lambda pipe: [pipe.delete(self._key(h)) for h in block_hashes])
        self._announce(False, [h for h, n in zip(block_hashes, deleted or ()) if n])
        return int(sum(deleted)) if deleted is not None else 0

    def _scan_delete(self, pattern: bytes) -> None:
        batch: list[bytes] = []
        for key in self._client.scan_iter(match=pattern, count=1000):  # never KEYS on a live server
            batch.append(key)
            if len(batch) >= 1000:
                self._client.delete(*batch)  # a cluster client splits by slot
                batch = []
        if batch:
            self._client.delete(*batch)

    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete this namespace's keys (SCAN by prefix); with `all_namespaces`, every
        `kvstrata:` key on the server."""
        self._check_open()
        self.flush()
        try:
            self._scan_delete(b"kvstrata:*" if all_namespaces else self._prefix + b"*")
        except Exception as exc:
            self._fault("clear", exc)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self.flush(timeout_s=10.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=5.0)
        with contextlib.suppress(Exception):  # closing a dead connection
            self._client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"remote tier {redacted(self._url)} is closed")

    def check_integrity(self) -> None:
        with self._cond:
            if self._queued_bytes != sum(v.nbytes for _, v in self._queue) or self._queued_bytes < 0:
                raise RuntimeError("remote tier: queued byte count disagrees with the queue (a bug)")

    def occupancy(self) -> Occupancy:
        """The server's memory (`used_memory` of `maxmemory`); blocks are not counted (0)."""
        used = capacity = 0
        if self._available():
            try:
                info = self._client.info("memory")
                if isinstance(info, dict) and "used_memory" not in info:  # a cluster: per node
                    info = {k: sum(int(v.get(k, 0)) for v in info.values() if isinstance(v, dict))
                            for k in ("used_memory", "maxmemory")}
                used, capacity = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
            except Exception as exc:
                self._fault("info", exc)
        return Occupancy(0, self.capacity_blocks, used, capacity)
