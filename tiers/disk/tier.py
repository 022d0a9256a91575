"""Disk tier: payloads in slot files, a small LMDB index beside them, byte-bounded LRU.

`disk_path` holds `data.mdb`/`lock.mdb` (the index, `tiers/disk/index.py`) and one sparse
file of fixed-size slots per payload size (`tiers/disk/files.py`). A write transaction (LMDB's
writer lock, shared by every process on the directory) applies buffered touches, evicts,
takes free slots (consecutive ones for a sequence, laid out in prefix order so a prefix reads
sequentially), writes the payloads straight from the source tensors (or as the tier's codec
encoded them, `tiers/disk/codec.py`), syncs them as the durability mode asks
(`tiers/disk/durability.py`), then commits the entries: an entry is committed only after its
bytes are written. Reads take the entries from one read transaction, read straight into the
destinations (encoded payloads: into a buffer, then decoded) and verify each block's
checksum; a mismatch is checked against a fresh transaction before it is called damage
(another process may have evicted the block and reused its slot meanwhile: a plain miss). An
entry this reader cannot verify (no token ids) or decode (a codec it does not know, load or
accept) is a miss left in place once its payload passes its checksum. Lookups probe an
in-memory copy of this namespace's hashes (`tiers/disk/mirror.py`) and touch no file.

Every namespace's blocks share one LRU order and one byte budget (each opener's own
`capacity_bytes` bounds what it writes); `scrub`, `clear` and `held_hashes` act on this
namespace only unless told otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import lmdb
import msgpack
import torch

from tiers.base import Occupancy, ScrubResult, Tier, TierCounters, TierTraits, plan_put
from tiers.changes import ChangeKind
from tiers.codecs import CodecSpec
from tiers.codecs.records import check_tokens
from tiers.disk import repair as disk_repair
from tiers.disk import scan as disk_scan
from tiers.disk.codec import DiskCodec
from tiers.disk.durability import DiskSync
from tiers.disk.env import acquire_env, begin, release_env
from tiers.disk.files import SlotFiles, file_name, slot_bytes_for
from tiers.disk.index import FORMAT, LOG_KEEP, Entry, block_cost, ns_tag
from tiers.disk.mirror import Mirror
from tiers.disk.payload import Prepared, read_payloads
from tiers.disk.scan import summarize
from tiers.disk.writer import DiskWriter, Layout
from tiers.errors import CorruptRecordError, DiskFullError, StoreClosedError, UnverifiableRecordError
from tiers.keys import BlockHash, BlockKey, TierKind

__all__ = ["DiskSync", "LMDBTier", "PayloadLocation", "ScrubResult", "bytes_per_block", "summarize"]
logger = logging.getLogger(__name__)
_MAX_PENDING_TOUCHES = 4096


class PayloadLocation(NamedTuple):
    """Where a block's bytes lie on disk: its index key, its payload's file and range, and
    the codec id the payload is stored in (0: raw bytes)."""

    index_key: bytes
    file: str
    offset: int
    length: int
    codec_id: int = 0


def bytes_per_block(block_bytes: int) -> int:
    """What one block of `block_bytes` counts against `capacity_bytes`."""
    return block_cost(slot_bytes_for(block_bytes))


class LMDBTier(Tier):
    """Blocks on disk, bounded by `capacity_bytes` (slots plus their index entries)."""

    kind = TierKind.DISK
    traits = TierTraits(persistent=True)

    def __init__(self, path: str, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 verify_tokens: bool = True, sync: DiskSync | bool | str = DiskSync.COMMIT, namespace: bytes = b"",
                 identity: object = None, read_bps: int | None = None, codec: CodecSpec | None = None) -> None:
        self._mode = DiskSync.parse(sync, "sync")
        self._shape, self._dtype = tuple(block_shape), dtype
        self._codec = DiskCodec(codec, self._shape, dtype)  # ConfigError: a codec that cannot be built
        self._block_bytes = self._codec.block_bytes
        self._cost = block_cost(self._codec.slot_bytes)
        self._verify_tokens = verify_tokens
        self._namespace = bytes(namespace)
        self._tag = ns_tag(self._namespace)
        self._capacity_bytes = capacity_bytes
        self._read_bps = read_bps
        entry_bytes = 512 + 4 * (block_shape[2] if len(block_shape) > 2 else 64)
        map_size = (96 << 20) + 4 * (capacity_bytes // self._cost + 1) * entry_bytes
        self._path, self._env = acquire_env(path, map_size, self._mode is DiskSync.COMMIT)
        self._pid = os.getpid()
        try:
            self._ix = disk_scan.open_index(self._env, path)
        except BaseException:
            release_env(self._path)
            raise
        self._files = SlotFiles(self._path)
        self._mirror = Mirror(self._env, self._ix, self._tag)
        self._mirror.refresh()
        self._pending: list[BlockHash] = []
        self._lock = threading.Lock()
        self._closed = False
        self.counters: TierCounters = self._ix.counters  # shared: the index counts the damage it finds
        self.num_unverifiable = 0  # sound blocks this reader cannot check or decode: misses
        self.num_unannounceable = 0  # see held_keys
        self.num_raced = 0  # blocks evicted by another process while being read: misses
        self._register(identity)
        layout = Layout(self._tag, self._codec, verify_tokens)
        self._writer = DiskWriter(self._env, self._ix, self._files, self._mirror, path=self._path, layout=layout,
                                  mode=self._mode, capacity_bytes=capacity_bytes)

    def _register(self, identity: object) -> None:
        """Record the format and this namespace's identity and budget (for `kvstrata
        inspect`), check the index's counters and free the slots damaged entries left unnamed
        (`disk_repair.recover`). Best effort: a full disk must not fail an open."""
        entry = msgpack.packb({"identity": identity, "capacity_bytes": self._capacity_bytes,
                               "tag": self._tag, "block_bytes": self._block_bytes}, use_bin_type=True, default=str)
        try:
            with begin(self._env, write=True) as txn:
                txn.put(b"format", FORMAT, db=self._ix.meta)
                damage = disk_repair.recover(self._ix, txn)
                txn.put(b"ns:" + self._namespace, entry, db=self._ix.meta)
            self._ix.note(damage)
        except lmdb.Error:
            pass

    # -- queries ---------------------------------------------------------------------------
    @property
    def index_syncs(self) -> tuple[int, int]:
        """(times the in-memory index was rebuilt whole, changes of other processes replayed
        into it from the change log); changes nothing."""
        return self._mirror.num_rebuilds, self._mirror.num_replayed

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_bytes // self._cost

    @property
    def path(self) -> str:
        return self._path

    @property
    def mode(self) -> DiskSync:
        return self._mode

    def __len__(self) -> int:
        self._check_open()
        with begin(self._env) as txn:
            return int(txn.stat(self._ix.index)["entries"])

    def held_hashes(self) -> Iterator[BlockHash]:
        """This namespace's blocks, from the in-memory index (current as of this call)."""
        self._check_open()
        return iter(self._mirror.snapshot())

    def held_keys(self) -> Iterator[BlockKey]:
        """This namespace's blocks whose entries carry token ids, parent and extras, each after
        its parent (roots first), read in one snapshot; `num_unannounceable` counts this
        namespace's blocks without them (stored without KV events or token verification)."""
        self._check_open()
        keys, num_without = disk_scan.held_keys(self._env, self._ix, self._tag)
        self.num_unannounceable = num_without
        if num_without:
            logger.info("kvstrata: %d disk blocks are not announced in KV events: their entries carry no parent, "
                        "extras or token ids (stored without KV events, or without verify_tokens)", num_without)
        return iter(keys)

    def payload_location(self, block_hash: BlockHash) -> PayloadLocation | None:
        """Where one of this namespace's blocks lies: its index key, its payload's file,
        offset, length and codec (for diagnosis); None if not held. Changes nothing."""
        self._check_open()
        key = self._key(block_hash)
        with begin(self._env, db=self._ix.index) as txn:
            raw = txn.get(key)
        if raw is None:
            return None
        e = disk_scan.unpack(raw)
        return PayloadLocation(key, os.path.join(self._path, file_name(e.slot_bytes)), e.slot * e.slot_bytes, e.length,
                               e.codec)

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        return self._mirror.count_prefix(block_hashes, start)

    def _key(self, block_hash: BlockHash) -> bytes:
        return self._tag + bytes(block_hash)

    # -- reads -----------------------------------------------------------------------------
    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        t0 = time.perf_counter()
        n, num_bytes = self._read(keys, dsts)
        if self._read_bps is not None and n:  # the bytes read as stored (encoded)
            time.sleep(max(0.0, num_bytes / self._read_bps - (time.perf_counter() - t0)))
        return n

    def _check_entry(self, e: Entry, key: BlockKey) -> None:
        if e.length > self._block_bytes or e.slot_bytes > self._codec.raw_slot_bytes:  # (an encoding is smaller)
            raise CorruptRecordError("entry larger than this tier's blocks")
        self._codec.check(e)
        check_tokens(self._verify_tokens, key.tokens, e.tokens, "entry")

    def _read(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> tuple[int, int]:
        """Blocks delivered into `dsts`, and the bytes of their payloads as stored."""
        entries: list[Entry] = []
        damaged: tuple[bytes, int | None] | None = None
        unverifiable: tuple[bytes, Entry] | None = None
        with begin(self._env, db=self._ix.index, buffers=True) as txn:
            for key in keys[: len(dsts)]:
                raw = txn.get(self._key(key.block_hash))
                if raw is None:
                    break
                try:
                    e = disk_scan.unpack(raw)
                except CorruptRecordError:
                    damaged = (self._key(key.block_hash), None)
                    break
                try:
                    self._check_entry(e, key)
                except UnverifiableRecordError:
                    unverifiable = (self._key(key.block_hash), e)
                    break
                except CorruptRecordError:
                    damaged = (self._key(key.block_hash), None)
                    break
                entries.append(e)
        ekeys = [self._key(k.block_hash) for k in keys[: len(entries)]]
        result = read_payloads(self._files, ekeys, entries, dsts, self._dtype, self._shape, self._codec.decode)
        if result.failed is not None:
            e = entries[result.failed]
            if result.undecodable or disk_scan.same_entry(self._env, self._ix, ekeys[result.failed], e):
                damaged = (ekeys[result.failed], e.gen)
            else:
                self.num_raced += 1
                damaged = None
        elif unverifiable is not None:  # a miss if sound; an entry damaged into that shape is damage
            ukey, ue = unverifiable
            if disk_scan.payload_sound(self._files, ukey, ue):
                self.num_unverifiable += 1
            elif disk_scan.same_entry(self._env, self._ix, ukey, ue):
                damaged = (ukey, ue.gen)
            else:
                self.num_raced += 1
        if damaged is not None:
            self._ix.note([f"block {damaged[0].hex()}: its entry or payload is damaged; deleted, a miss"])
            with contextlib.suppress(DiskFullError):  # (deleted by a later read, or a scrub)
                self._remove([damaged], damaged=True)
        return result.num_ok, sum(e.length for e in entries[: result.num_ok])

    # -- writes ----------------------------------------------------------------------------
    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        touched = [k.block_hash for k in keys]
        held = self._mirror.held(touched)
        _, fresh = plan_put(keys, held.__contains__, len(keys))
        if not fresh:
            self.touch(touched)
            return 0
        return self._write(self._writer.prepare(keys, srcs, fresh), touched, [keys[p] for p in fresh])

    def _write(self, blocks: list[Prepared], touched: list[BlockHash], keys: Sequence[BlockKey] = ()) -> int:
        """One write transaction with the buffered touches; they are kept if it fails. The
        blocks it added are recorded as entered by their `keys`."""
        with self._lock:
            pending, self._pending = self._pending, []
        try:
            done = self._writer.put(blocks, [self._key(h) for h in pending + touched])
        except BaseException:
            with self._lock:
                self._pending[:0] = pending
            raise
        self.counters.num_evictions += done.num_evicted
        self._record_removed(done.removed)
        if done.added:
            by_key = {self._key(k.block_hash): k for k in keys}
            self._record(ChangeKind.ENTERED, [by_key[k] for k in done.added if k in by_key])
        return len(done.added)

    def _remove(self, items: Sequence[tuple[bytes, int | None]], *, damaged: bool = False,
                reclaim: bool = False) -> int:
        removed = self._writer.remove(items, damaged=damaged, reclaim=reclaim).removed
        self._record_removed(removed)
        return len(removed)

    def _record_removed(self, keys: list[bytes]) -> None:
        """Record as left the blocks of this namespace among the index keys removed."""
        n = len(self._tag)
        self._record(ChangeKind.LEFT, [BlockHash(k[n:]) for k in keys if k[:n] == self._tag])

    # -- recency, deletion, lifecycle ------------------------------------------------------
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
            self._write([], [])
        except DiskFullError:
            with self._lock:
                self._pending.clear()
        return True

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        return self._remove([(self._key(h), None) for h in block_hashes])

    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete this namespace's blocks; with `all_namespaces`, every block in the
        directory, whoever wrote it (the data files are emptied)."""
        self._check_open()
        if all_namespaces:
            mine = self._mirror.snapshot()
            with begin(self._env, write=True) as txn:
                disk_scan.wipe(self._ix, txn, LOG_KEEP)
                self._files.truncate_all()
            self._mirror.refresh()
            self._record(ChangeKind.LEFT, mine)
        else:
            with begin(self._env, buffers=True) as txn:
                keys = list(self._ix.keys_of(txn, self._tag))
            self._remove([(k, None) for k in keys])
        with self._lock:
            self._pending.clear()

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._pending and os.getpid() == self._pid:
                self.flush()
        finally:
            self._closed = True
            if os.getpid() == self._pid:
                self._writer.close()
                self._mirror.close()
                release_env(self._path)
            self._files.close()

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
        disk_scan.check_integrity(self._env, self._ix, self._mirror, self._tag)

    def scrub(self) -> ScrubResult:
        """Verify every block's entry and payload checksum (any namespace) and delete the
        damaged ones; sound blocks of other namespaces are counted and left alone. Reads in
        one snapshot, deletes in one write transaction, which also drops the damaged records
        of the other sub-databases (counted in the stats' `num_corrupt`, not in the result).
        Token ids are checked against the entry's own (the caller's tokens are not known)."""
        self._check_open()
        result, damaged = disk_scan.scrub(self._env, self._ix, self._files, self._tag, self._codec)
        num = self._remove(damaged, damaged=True, reclaim=True)  # and sweeps the other sub-databases
        if num:
            self._ix.note([f"scrub deleted {num} damaged blocks"], count=num)
        return result._replace(num_corrupt=num)

    def occupancy(self) -> Occupancy:
        self._check_open()
        with begin(self._env) as txn:
            used = self._ix.get_u64(txn, b"used")
            num = int(txn.stat(self._ix.index)["entries"])
        return Occupancy(num, self.capacity_blocks, used, self._capacity_bytes)
