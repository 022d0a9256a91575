"""Disk tier: LMDB under `disk_path`, checksummed records, byte-bounded LRU eviction.

Records are `tiers/lmdb_record.py`'s; one that fails validation on read is a miss and is
deleted. The LRU order lives in LMDB itself (sub-databases `atime`
hash->tick and `lru` tick->hash), so a reopened store finds everything committed and
evicts in the same order. Reads never take LMDB's writer lock: their recency updates are
buffered and applied in the next write transaction.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence

import lmdb
import msgpack
import torch

from tiers.base import BlockHash, BlockKey, Occupancy, ScrubResult, Tier, TierCounters, TierKind, TierTraits
from tiers.codecs import CodecSpec
from tiers.errors import ConfigError, CorruptRecordError, DiskFullError, StoreClosedError
from tiers.lmdb_env import acquire_env, begin, disk_full_reason, release_env
from tiers.lmdb_record import RecordCodec, UnverifiableRecordError, record_bytes_on_disk

logger = logging.getLogger(__name__)
_U64 = struct.Struct("<Q")
_TICK = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order
_MAX_PENDING_TOUCHES = 4096
_DB_NAMES = (b"blocks", b"atime", b"lru", b"meta")


class LMDBTier(Tier):
    """Blocks in an LMDB environment, bounded by `capacity_bytes` of disk (pages counted)."""

    kind = TierKind.DISK
    traits = TierTraits(persistent=True)

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
        identity: object = None,
        read_bps: int | None = None,
        codec: CodecSpec | None = None,
    ) -> None:
        self.codec = RecordCodec(block_shape, dtype, verify_tokens=verify_tokens, namespace=namespace, codec=codec)
        self._namespace = self.codec.namespace
        self._block_bytes = self.codec.block_bytes
        self._capacity_bytes = capacity_bytes
        self._read_bps = read_bps  # a cap on read bandwidth (None: none)
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
        self.counters = TierCounters()
        self._num_unverifiable = 0
        self.num_unannounceable = 0  # see held_keys
        self._register(identity)

    def _register(self, identity: object) -> None:
        """Record this namespace's identity and budget in `meta` (what `kvstrata inspect`
        shows). Best effort: a full disk must not fail an open."""
        entry = msgpack.packb({"identity": identity, "capacity_bytes": self._capacity_bytes}, use_bin_type=True,
                              default=str)
        try:
            with begin(self._env, write=True) as txn:
                txn.put(b"ns:" + self._namespace, entry, db=self._meta)
        except lmdb.Error:
            pass

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

    def held_hashes(self) -> Iterator[BlockHash]:
        """This namespace's blocks (each record's header names its owner), read in one
        snapshot."""
        self._check_open()
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            mine = [BlockHash(bytes(h)) for h, v in txn.cursor() if self.codec.owner(v) == self._namespace]
        return iter(mine)

    def held_keys(self) -> Iterator[BlockKey]:
        """This namespace's blocks whose records carry token ids, parent and extras, read in
        one snapshot; `num_unannounceable` counts this namespace's records without them
        (written before they existed, or without token verification)."""
        self._check_open()
        keys: list[BlockKey] = []
        mine = 0
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            for h, v in txn.cursor():
                if self.codec.owner(v) != self._namespace:
                    continue
                mine += 1
                key = self.codec.announced_key(v, bytes(h))
                if key is not None:
                    keys.append(key)
        self.num_unannounceable = mine - len(keys)
        if self.num_unannounceable:
            logger.info("kvstrata: %d disk blocks are not announced in KV events: their records carry no parent or "
                        "token ids (written by an older kvstrata, or without verify_tokens)", self.num_unannounceable)
        return iter(keys)

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        n, end = start, len(block_hashes)
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            while n < end and txn.get(block_hashes[n]) is not None:
                n += 1
        return n - start

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        t0 = time.perf_counter()
        n, num_bytes = self._read(keys, dsts)
        if self._read_bps is not None and n:  # the bytes read as stored (encoded)
            time.sleep(max(0.0, num_bytes / self._read_bps - (time.perf_counter() - t0)))
        return n

    def _read(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> tuple[int, int]:
        """Blocks copied into `dsts` and the bytes of their records."""
        n = num_bytes = 0
        corrupt: list[BlockHash] = []
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            for key, dst in zip(keys, dsts):
                value = txn.get(key.block_hash)
                if value is None:
                    break
                try:
                    self.codec.copy_out(self.codec.decode(value, key), dst)
                except UnverifiableRecordError:
                    self._num_unverifiable += 1
                    break
                except CorruptRecordError:
                    corrupt.append(key.block_hash)
                    break
                n += 1
                num_bytes += len(value)
        if corrupt:
            self.counters.num_corrupt += len(corrupt)
            self._discard_damaged(corrupt)
        return n, num_bytes

    # -- writes ----------------------------------------------------------------------------
    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        keys = self._described(keys)  # a demoted block's parent and extras, for its record
        with begin(self._env, db=self._blocks, buffers=True) as txn:
            missing = [i for i, k in enumerate(keys) if txn.get(k.block_hash) is None]
        records: dict[BlockHash, bytearray] = {}
        for i in missing:  # encode outside the write transaction; last duplicate wins
            records.pop(keys[i].block_hash, None)
            records[keys[i].block_hash] = self.codec.encode(keys[i], srcs[i])
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
                reason = disk_full_reason(exc, self._path, sum(map(len, records.values())))
                if reason is not None:
                    raise DiskFullError(
                        f"disk tier at {self._path}: {reason}; nothing was written ({exc})"
                    ) from exc
                raise
        else:
            raise DiskFullError(
                f"disk tier at {self._path}: LMDB map full after evicting; nothing was written"
            )
        return written

    def _write(self, records: dict[BlockHash, bytearray], touched: list[BlockHash], extra: int) -> int:
        """One write transaction: apply buffered touches, evict, insert. Aborts as a whole."""
        with self._lock:
            pending, self._pending = self._pending, []
        evicted: list[BlockHash] = []
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
                used = self._evict_in(txn, used, used + total - budget, evicted)
                # Records go in prefix order (the reverse of eviction order), so a sequence's
                # pages lie forwards in the file and a read of its prefix is sequential (the
                # kernel's readahead then works); ticks still follow eviction order.
                for j in range(len(fresh) - 1, -1, -1):
                    h, v = fresh[j]
                    txn.put(h, v, db=self._blocks)
                    txn.put(h, _TICK.pack(tick + j), db=self._atime)
                    txn.put(_TICK.pack(tick + j), h, db=self._lru)
                tick += len(fresh)
                used += sum(sizes)
                self._write_meta(txn, tick, used)
        except BaseException:
            with self._lock:
                self._pending[:0] = pending
            raise
        self._announce(False, evicted)  # committed: tell the listener
        self._announce(True, [h for h, _ in fresh])
        return len(fresh)

    def _evict_in(self, txn: lmdb.Transaction, used: int, num_bytes: float, evicted: list[BlockHash]) -> int:
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
            evicted.append(BlockHash(h))
        self.counters.num_evictions += len(victims)
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

    def flush(self) -> bool:
        """Apply buffered recency updates now (one write transaction); True.

        Best effort: on a full disk or map the updates are dropped (they only order eviction),
        so reads and `close()` never fail for want of room.
        """
        try:
            self._write({}, [], extra=0)
        except lmdb.Error as exc:
            full = disk_full_reason(exc, self._path, 0) is not None
            if not isinstance(exc, lmdb.MapFullError) and not full:
                raise
            with self._lock:
                self._pending.clear()
        return True

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        gone: list[BlockHash] = []
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
                gone.append(h)
            self._write_meta(txn, tick, max(0, used))
        self._announce(False, gone)
        return len(gone)

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
        self._announce(False, block_hashes)

    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete this namespace's records (their owner is in each header); with
        `all_namespaces`, every record in the directory, whoever wrote it."""
        self._check_open()
        if all_namespaces:
            mine = list(self.held_hashes())
            with begin(self._env, write=True) as txn:
                for db in (self._blocks, self._atime, self._lru, self._meta):
                    txn.drop(db, delete=False)
            self._announce(False, mine)
        else:
            self._discard_damaged(list(self.held_hashes()))
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
                    hdr, _ = self.codec.parse(value, key.block_hash)  # damaged for every reader
                    if hdr.get("ns", self._namespace) != self._namespace or (
                        "ns" not in hdr and not self.codec.is_own_layout(hdr)
                    ):
                        num_foreign += 1  # sound, another store's: not ours to judge or delete
                        continue
                    self.codec.decode(value, key)
                except CorruptRecordError:
                    damaged.append(key.block_hash)
                else:
                    num_ok += 1
        if damaged:
            self.counters.num_corrupt += len(damaged)
            self._discard_damaged(damaged)
        return ScrubResult(num_ok, len(damaged), num_foreign)

    def occupancy(self) -> Occupancy:
        self._check_open()
        with begin(self._env) as txn:
            _, used = self._read_meta(txn)
            num = int(txn.stat(self._blocks)["entries"])
        return Occupancy(num, self.capacity_blocks, used, self._capacity_bytes)
