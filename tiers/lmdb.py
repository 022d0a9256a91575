"""Disk tier: LMDB under `disk_path`, checksummed records, byte-bounded LRU eviction.

Record = b"KVS1" | u32 header length | msgpack header | raw block bytes. The header names
the format version, the key, the layout (dtype, shape), the payload length, the block's
token ids and an xxh3-64 checksum over key, tokens and payload. Any mismatch on read is a
miss and the record is deleted. The LRU order lives in LMDB itself (sub-databases `atime`
hash->tick and `lru` tick->hash), so a reopened store finds everything committed and
evicts in the same order. Reads never take LMDB's writer lock: their recency updates are
buffered and applied in the next write transaction.
"""

from __future__ import annotations

import errno
import os
import resource
import struct
import threading
from collections.abc import Sequence
from typing import NamedTuple

import lmdb
import msgpack
import numpy as np
import torch
import xxhash

from tiers.base import BlockHash, BlockKey, Tier, TierKind, TierStats
from tiers.blockcopy import copy_block
from tiers.errors import ConfigError, CorruptRecordError, DiskFullError, StoreClosedError
from tiers.lmdb_env import acquire_env, begin, release_env

FORMAT_VERSION = 1
_MAGIC = b"KVS1"
_PREFIX = struct.Struct("<4sI")
_U64 = struct.Struct("<Q")
_TICK = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order
_PAGE = 4096
_ENTRY_OVERHEAD = 128  # atime + lru entries and B-tree slack per block
_MAX_PENDING_TOUCHES = 4096
_DB_NAMES = (b"blocks", b"atime", b"lru", b"meta")


def record_bytes_on_disk(value_len: int) -> int:
    """Bytes a record of `value_len` occupies in LMDB: overflow pages plus index entries."""
    return -(-(value_len + 16) // _PAGE) * _PAGE + _ENTRY_OVERHEAD


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXTS = ("No space left", "quota exceeded", "File too large")


def _disk_full_reason(exc: BaseException, path: str, num_bytes: int) -> str | None:
    """Why a failed LMDB write was for want of room, or None if it was not.

    LMDB reports a short write as EIO ("Input/output error"): that is what a file system
    that fills, or a file-size limit, does mid-commit. EIO counts as full only when the free
    space or the RLIMIT_FSIZE headroom is below `num_bytes` (plus slack) right after.
    """
    text = str(exc)
    if getattr(exc, "errno", None) in _FULL_ERRNOS or any(t in text for t in _FULL_TEXTS):
        return "file system full"
    if "Input/output error" not in text:
        return None
    need = num_bytes + (4 << 20)
    try:
        st = os.statvfs(path)
        if st.f_bavail * st.f_frsize < need:
            return "file system full (LMDB saw a short write)"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            size = os.path.getsize(os.path.join(path, "data.mdb"))
            if size + need > limit:
                return f"file size limit of {limit} bytes reached (LMDB saw a short write)"
    except OSError:
        return None
    return None


class ScrubResult(NamedTuple):
    """What `LMDBTier.scrub` found: records of this namespace that validated, damaged ones it
    deleted, and records of other stores sharing the directory (left alone)."""

    num_ok: int
    num_corrupt: int
    num_foreign: int = 0


class UnverifiableRecordError(CorruptRecordError):
    """A sound record without the token ids this reader verifies: a miss, not deleted."""


class LMDBTier(Tier):
    """Blocks in an LMDB environment, bounded by `capacity_bytes` of disk (pages counted)."""

    kind = TierKind.DISK

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        verify_tokens: bool = True,
        sync: bool = True,
        namespace: bytes = b"",
    ) -> None:
        self._shape = list(block_shape)
        self._namespace = bytes(namespace)
        self._dtype = dtype
        self._dtype_name = str(dtype).removeprefix("torch.")
        self._block_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self._capacity_bytes = capacity_bytes
        self._verify_tokens = verify_tokens
        self._path, self._env = acquire_env(path, 2 * capacity_bytes + (64 << 20), sync)
        self._pid = os.getpid()
        try:
            self._dbs = {name: self._env.open_db(name) for name in _DB_NAMES}
        except lmdb.Error as exc:  # e.g. a foreign LMDB whose main database has a key "meta"
            release_env(self._path)
            raise ConfigError(f"disk_path {path!r} holds an LMDB store that is not kvstrata's: {exc}") from None
        self._blocks, self._atime, self._lru, self._meta = (self._dbs[n] for n in _DB_NAMES)
        self._pending: list[BlockHash] = []
        self._lock = threading.Lock()
        self._closed = False
        self._num_hits = self._num_puts = self._num_evictions = self._num_corrupt = 0
        self._num_unverifiable = 0

    # -- encoding --------------------------------------------------------------------------
    def _header(self, key: BlockKey, checksum: bytes) -> bytes:
        return msgpack.packb(  # type: ignore[no-any-return]  # msgpack is untyped: packb returns bytes
            {"v": FORMAT_VERSION, "key": bytes(key.block_hash), "ns": self._namespace, "dtype": self._dtype_name,
             "shape": self._shape, "n": self._block_bytes,
             "tok": key.tokens if self._verify_tokens else b"", "xxh": checksum},
            use_bin_type=True,
        )

    @staticmethod
    def _checksum(block_hash: bytes, tokens: bytes, payload: memoryview | bytes) -> bytes:
        h = xxhash.xxh3_64()
        h.update(block_hash)
        h.update(tokens)
        h.update(payload)
        return h.digest()

    def encode(self, key: BlockKey, src: torch.Tensor) -> bytearray:
        """Build the record for one block (one copy of the KV bytes)."""
        hlen = len(self._header(key, bytes(8)))
        off = _PREFIX.size + hlen
        buf = bytearray(off + self._block_bytes)
        payload = torch.frombuffer(buf, dtype=torch.uint8, offset=off, count=self._block_bytes)
        copy_block(payload.view(self._dtype).view(self._shape), src)
        tokens = key.tokens if self._verify_tokens else b""
        header = self._header(key, self._checksum(key.block_hash, self._namespace + tokens, memoryview(buf)[off:]))
        buf[: _PREFIX.size] = _PREFIX.pack(_MAGIC, hlen)
        buf[_PREFIX.size : off] = header
        return buf

    @staticmethod
    def parse(value: memoryview | bytes, block_hash: bytes) -> tuple[dict[str, object], memoryview]:
        """A record's header and payload, checked for self-consistency only (magic, format,
        key, payload length, checksum over key, namespace tag, tokens and payload); raise
        `CorruptRecordError` if damaged. Says nothing about whether it is this tier's."""
        mv = memoryview(value)
        if len(mv) < _PREFIX.size:
            raise CorruptRecordError("record shorter than its prefix")
        magic, hlen = _PREFIX.unpack(mv[: _PREFIX.size])
        if magic != _MAGIC or _PREFIX.size + hlen > len(mv):
            raise CorruptRecordError("bad magic or header length")
        try:
            hdr = msgpack.unpackb(mv[_PREFIX.size : _PREFIX.size + hlen], raw=False)
        except Exception as exc:  # msgpack raises many types on garbage
            raise CorruptRecordError(f"undecodable header: {exc}") from None
        payload = mv[_PREFIX.size + hlen :]
        if not isinstance(hdr, dict) or hdr.get("v") != FORMAT_VERSION:
            raise CorruptRecordError("unknown record format")
        if hdr.get("key") != bytes(block_hash):
            raise CorruptRecordError("record stored under another key")
        if hdr.get("n") != len(payload):
            raise CorruptRecordError("payload length mismatch")
        tokens, ns = hdr.get("tok"), hdr.get("ns", b"")
        if not isinstance(tokens, bytes) or not isinstance(ns, bytes):
            raise CorruptRecordError("bad token or namespace field")
        if LMDBTier._checksum(block_hash, ns + tokens, payload) != hdr.get("xxh"):
            raise CorruptRecordError("checksum mismatch")
        return hdr, payload

    def decode(self, value: memoryview | bytes, key: BlockKey) -> memoryview:
        """Validate a record as this tier's block `key` and return its payload; raise
        `CorruptRecordError` if damaged (`UnverifiableRecordError` if it is sound but has no
        token ids to check against `key.tokens`)."""
        hdr, payload = self.parse(value, key.block_hash)
        if hdr.get("ns", self._namespace) != self._namespace:
            raise CorruptRecordError("record of another namespace under this key")
        if hdr.get("dtype") != self._dtype_name or hdr.get("shape") != self._shape or len(payload) != self._block_bytes:
            raise CorruptRecordError("record layout differs from this tier's")
        tokens = hdr["tok"]
        if self._verify_tokens and key.tokens and tokens != key.tokens:
            if not tokens:  # written without token ids (verify_tokens=False): sound, unverifiable
                raise UnverifiableRecordError("record carries no token ids to verify")
            raise CorruptRecordError("token ids differ (hash collision or damage)")
        return payload

    @staticmethod
    def _read_header(value: memoryview | bytes) -> dict[str, object] | None:
        """A record's msgpack header, or None if it cannot be read."""
        try:
            _, hlen = _PREFIX.unpack(value[: _PREFIX.size])
            hdr = msgpack.unpackb(value[_PREFIX.size : _PREFIX.size + hlen], raw=False)
        except Exception:  # garbage of any kind: nothing can be read
            return None
        return hdr if isinstance(hdr, dict) else None

    def _owner(self, value: memoryview | bytes) -> bytes | None:
        """The namespace tag in a record's header; None if unreadable or absent (older records)."""
        ns = (self._read_header(value) or {}).get("ns")
        return ns if isinstance(ns, bytes) else None

    def _copy_out(self, payload: memoryview, dst: torch.Tensor) -> None:
        src = np.frombuffer(payload, dtype=np.uint8)
        target = dst if dst.device.type == "cpu" else torch.empty(self._shape, dtype=self._dtype)
        try:
            view = target.view(torch.uint8).numpy()
        except RuntimeError:  # strides that a byte view cannot express
            target = torch.empty(self._shape, dtype=self._dtype)
            view = target.view(torch.uint8).numpy()
        np.copyto(view, src.reshape(view.shape))
        if target is not dst:
            dst.copy_(target)

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self._capacity_bytes // record_bytes_on_disk(self._block_bytes + 256)

    @property
    def path(self) -> str:
        return self._path

    def __len__(self) -> int:
        self._check_open()
        with begin(self._env) as txn:
            return int(txn.stat(self._blocks)["entries"])

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        n, end = start, len(block_hashes)
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            while n < end and txn.get(block_hashes[n]) is not None:
                n += 1
        return n - start

    def get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        self._check_open()
        n = 0
        corrupt: list[BlockHash] = []
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            for key, dst in zip(keys, dsts):
                value = txn.get(key.block_hash)
                if value is None:
                    break
                try:
                    payload = self.decode(value, key)
                except UnverifiableRecordError:
                    self._num_unverifiable += 1
                    break
                except CorruptRecordError:
                    corrupt.append(key.block_hash)
                    break
                self._copy_out(payload, dst)
                n += 1
        if corrupt:
            self._num_corrupt += len(corrupt)
            self._discard_damaged(corrupt)
        self._num_hits += n
        self.touch([k.block_hash for k in reversed(keys[:n])])
        return n

    # -- writes ----------------------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        self._check_open()
        if len(keys) != len(srcs):
            raise ValueError(f"put got {len(keys)} keys but {len(srcs)} tensors")
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            missing = [i for i, k in enumerate(keys) if txn.get(k.block_hash) is None]
        records: dict[BlockHash, bytearray] = {}
        for i in missing:  # encode outside the write transaction; last duplicate wins
            records.pop(keys[i].block_hash, None)
            records[keys[i].block_hash] = self.encode(keys[i], srcs[i])
        for attempt in range(4):
            try:
                written = self._write(records, [k.block_hash for k in keys], extra=attempt)
                break
            except lmdb.MapFullError:
                # A process killed inside a read transaction leaves its slot in the reader
                # table, pinning every page freed since: clear dead readers, then retry.
                self._env.reader_check()
                continue
            except lmdb.Error as exc:
                reason = _disk_full_reason(exc, self._path, sum(map(len, records.values())))
                if reason is not None:
                    raise DiskFullError(
                        f"disk tier at {self._path}: {reason}; nothing was written ({exc})"
                    ) from exc
                raise
        else:
            raise DiskFullError(
                f"disk tier at {self._path}: LMDB map full after evicting; nothing was written"
            )
        self._num_puts += written
        return written

    def _write(self, records: dict[BlockHash, bytearray], touched: list[BlockHash], extra: int) -> int:
        """One write transaction: apply buffered touches, evict, insert. Aborts as a whole."""
        with self._lock:
            pending, self._pending = self._pending, []
        try:
            with begin(self._env, write=True) as txn:
                tick, used = self._read_meta(txn)
                tick = self._touch_in(txn, pending + touched, tick)
                fresh = [(h, v) for h, v in records.items() if txn.get(h, db=self._blocks) is None]
                sizes = [record_bytes_on_disk(len(v)) for _, v in fresh]
                budget = self._capacity_bytes * (1.0 - 0.15 * extra)
                total, skip = sum(sizes), 0
                while skip < len(fresh) and total > budget:  # the most evictable never enter
                    total -= sizes[skip]
                    skip += 1
                fresh, sizes = fresh[skip:], sizes[skip:]
                used = self._evict_in(txn, used, used + total - budget)
                for (h, v), size in zip(fresh, sizes):
                    txn.put(h, v, db=self._blocks)
                    txn.put(h, _TICK.pack(tick), db=self._atime)
                    txn.put(_TICK.pack(tick), h, db=self._lru)
                    tick += 1
                    used += size
                self._write_meta(txn, tick, used)
        except BaseException:
            with self._lock:
                self._pending[:0] = pending
            raise
        return len(fresh)

    def _evict_in(self, txn: lmdb.Transaction, used: int, num_bytes: float) -> int:
        if num_bytes <= 0:
            return used
        freed = 0
        cursor = txn.cursor(db=self._lru)
        victims = []
        for tick_key, h in cursor.iternext():
            if freed >= num_bytes:
                break
            value = txn.get(h, db=self._blocks)
            victims.append((bytes(tick_key), bytes(h)))
            freed += record_bytes_on_disk(len(value)) if value is not None else 0
        for tick_key, h in victims:
            txn.delete(tick_key, db=self._lru)
            txn.delete(h, db=self._atime)
            txn.delete(h, db=self._blocks)
        self._num_evictions += len(victims)
        return max(0, used - freed)

    def _touch_in(self, txn: lmdb.Transaction, hashes: Sequence[BlockHash], tick: int) -> int:
        for h in hashes:
            old = txn.get(h, db=self._atime)
            if old is None:
                continue
            txn.delete(bytes(old), db=self._lru)
            txn.put(h, _TICK.pack(tick), db=self._atime)
            txn.put(_TICK.pack(tick), h, db=self._lru)
            tick += 1
        return tick

    def _read_meta(self, txn: lmdb.Transaction) -> tuple[int, int]:
        tick = txn.get(b"tick", db=self._meta)
        used = txn.get(b"bytes", db=self._meta)
        return (_U64.unpack(tick)[0] if tick else 0), (_U64.unpack(used)[0] if used else 0)

    def _write_meta(self, txn: lmdb.Transaction, tick: int, used: int) -> None:
        txn.put(b"tick", _U64.pack(tick), db=self._meta)
        txn.put(b"bytes", _U64.pack(used), db=self._meta)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        self._check_open()
        with self._lock:
            self._pending.extend(block_hashes)
            flush = len(self._pending) > _MAX_PENDING_TOUCHES
        if flush:
            self.flush()

    def flush(self) -> None:
        """Apply buffered recency updates now (one write transaction).

        Best effort: on a full disk or map the updates are dropped (they only order eviction),
        so reads and `close()` never fail for want of room.
        """
        try:
            self._write({}, [], extra=0)
        except lmdb.Error as exc:
            full = _disk_full_reason(exc, self._path, 0) is not None
            if not isinstance(exc, lmdb.MapFullError) and not full:
                raise
            with self._lock:
                self._pending.clear()

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        n = 0
        with begin(self._env, write=True) as txn:
            tick, used = self._read_meta(txn)
            for h in block_hashes:
                value = txn.get(h, db=self._blocks)
                if value is None:
                    continue
                used -= record_bytes_on_disk(len(value))
                old = txn.get(h, db=self._atime)
                if old is not None:
                    txn.delete(bytes(old), db=self._lru)
                txn.delete(h, db=self._atime)
                txn.delete(h, db=self._blocks)
                n += 1
            self._write_meta(txn, tick, max(0, used))
        return n

    def _discard_damaged(self, block_hashes: Sequence[BlockHash]) -> None:
        """Delete damaged records, then recount the bytes used from the records left.

        A damaged record's length need not be the length it was accounted at (a truncated or
        overwritten value), so subtracting it would leave the accounting off for good.
        """
        with begin(self._env, write=True, buffers=True) as txn:
            tick, _ = self._read_meta(txn)
            for h in block_hashes:
                old = txn.get(h, db=self._atime)
                if old is not None:
                    txn.delete(bytes(old), db=self._lru)
                txn.delete(h, db=self._atime)
                txn.delete(h, db=self._blocks)
            cursor = txn.cursor(db=self._blocks)
            used = sum(record_bytes_on_disk(len(v)) for v in cursor.iternext(keys=False))
            self._write_meta(txn, tick, used)

    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete this namespace's records (their owner is in each header); with
        `all_namespaces`, every record in the directory, whoever wrote it."""
        self._check_open()
        if all_namespaces:
            with begin(self._env, write=True) as txn:
                for db in (self._blocks, self._atime, self._lru, self._meta):
                    txn.drop(db, delete=False)
        else:
            with begin(self._env, db=self._blocks, buffers=True) as txn:
                mine = [BlockHash(bytes(h)) for h, v in txn.cursor() if self._owner(v) == self._namespace]
            self._discard_damaged(mine)
        with self._lock:
            self._pending.clear()

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._pending:
                self.flush()
        finally:
            self._closed = True
            if os.getpid() == self._pid:
                release_env(self._path)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"disk tier at {self._path} is closed")
        if os.getpid() != self._pid:
            raise StoreClosedError(
                f"disk tier at {self._path} was opened by process {self._pid} before a fork; LMDB handles do not "
                "cross fork(): open a new KVCacheStore in this process"
            )

    def check_integrity(self) -> None:
        self._check_open()
        with begin(self._env, buffers=False) as txn:
            _, used = self._read_meta(txn)
            total = 0
            n_blocks = 0
            for h, value in txn.cursor(db=self._blocks):
                n_blocks += 1
                total += record_bytes_on_disk(len(value))
                tick = txn.get(h, db=self._atime)
                if tick is None or txn.get(tick, db=self._lru) != h:
                    raise RuntimeError(f"disk tier: block {h.hex()} missing from the LRU index (a bug)")
            n_lru = txn.stat(self._lru)["entries"]
            n_atime = txn.stat(self._atime)["entries"]
            if not n_blocks == n_lru == n_atime:
                raise RuntimeError(
                    f"disk tier: {n_blocks} blocks, {n_atime} atime, {n_lru} lru entries (a bug)"
                )
            if total != used:
                raise RuntimeError(f"disk tier: accounted {used} bytes, records take {total} (a bug)")

    def scrub(self) -> ScrubResult:
        """Validate every record (header, key, checksum; layout for this namespace's); delete
        the damaged ones. Sound records of other stores sharing the directory are counted and
        left alone.

        Reads in one snapshot, then deletes in one write transaction. Token ids are checked
        against the record's own header only (the caller's tokens are not known here).
        """
        self._check_open()
        damaged: list[BlockHash] = []
        num_ok = num_foreign = 0
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            for h, value in txn.cursor():
                key = BlockKey(BlockHash(bytes(h)))
                try:
                    hdr, _ = self.parse(value, key.block_hash)  # damaged for every reader
                    if hdr.get("ns", self._namespace) != self._namespace or (
                        "ns" not in hdr and (hdr.get("dtype"), hdr.get("shape")) != (self._dtype_name, self._shape)
                    ):
                        num_foreign += 1  # sound, another store's: not ours to judge or delete
                        continue
                    self.decode(value, key)
                except CorruptRecordError:
                    damaged.append(key.block_hash)
                else:
                    num_ok += 1
        if damaged:
            self._num_corrupt += len(damaged)
            self._discard_damaged(damaged)
        return ScrubResult(num_ok, len(damaged), num_foreign)

    def stats(self) -> TierStats:
        self._check_open()
        with begin(self._env) as txn:
            _, used = self._read_meta(txn)
            num = txn.stat(self._blocks)["entries"]
        return TierStats(
            kind=self.kind, num_blocks=num, capacity_blocks=self.capacity_blocks,
            used_bytes=used, capacity_bytes=self._capacity_bytes, num_hits=self._num_hits,
            num_puts=self._num_puts, num_evictions=self._num_evictions,
            num_corrupt=self._num_corrupt,
        )
