"""The disk tier's write transactions: payloads first, then the entries that name them.

One write transaction (LMDB's writer lock, shared by every process on the directory) applies
buffered touches, evicts down to the budget, takes slots (free ones first, then new ones at
the end of the file, of each block's slot size; laid out in prefix order, so a prefix reads
forwards), gives the space of slots left free back to the file system, writes the payloads
straight from the source tensors (blocks the tier's codec encoded, before the lock, from
their encoding), syncs them as the durability mode asks, and only then puts the entries and
commits.
A process killed anywhere in between leaves the index as it was before (its payload bytes
land in slots no committed entry names). A full file system, a file-size limit or a full
index map is a `DiskFullError` with nothing written. Each transaction first checks the
counters it starts from (`disk_repair.settle`); damaged index records it meets are dropped,
and noted (counted, warned) once it commits.
"""

from __future__ import annotations

import errno
import resource
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import lmdb
import numpy as np
import torch

from tiers.disk import repair as disk_repair
from tiers.disk.batch import WriteBatch
from tiers.disk.codec import DiskCodec
from tiers.disk.durability import DiskSync, GroupSync
from tiers.disk.env import begin, disk_full_reason
from tiers.disk.files import SlotFiles
from tiers.disk.index import CODEC_RAW, Entry, Index, block_cost, unpack_entry
from tiers.disk.mirror import Mirror
from tiers.disk.payload import Prepared, source_pieces, write_payloads
from tiers.errors import CorruptRecordError, DiskFullError
from tiers.keys import BlockKey

_FULL_ERRNOS = {errno.ENOSPC: "file system full", errno.EDQUOT: "disk quota exceeded"}
_T = TypeVar("_T")


class WriteOutcome(NamedTuple):
    """What a committed write transaction did: index keys it added and removed (any
    namespace's), and how many it evicted to make room."""

    added: list[bytes]
    removed: list[bytes]
    num_evicted: int


class Layout(NamedTuple):
    """What the blocks of one disk tier are: its namespace tag, its codecs (layout tags, slot
    sizes, encoding), and whether token ids are kept."""

    tag: bytes
    codec: DiskCodec
    verify_tokens: bool


class DiskWriter:
    """The write side of one disk tier (thread-safe through LMDB's writer lock)."""

    def __init__(self, env: lmdb.Environment, ix: Index, files: SlotFiles, mirror: Mirror, *, path: str,
                 layout: Layout, mode: DiskSync, capacity_bytes: int) -> None:
        self._env, self._ix, self._files, self._mirror = env, ix, files, mirror
        self._path, self._lay, self._mode = path, layout, mode
        self._capacity_bytes = capacity_bytes
        self._env_syncs = bool(env.flags().get("sync", False))
        self._group = GroupSync(self.sync_all, path) if mode is DiskSync.GROUP else None

    def prepare(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor], positions: list[int]) -> list[Prepared]:
        """Entries (slot and checksum still 0) and payload pieces of the blocks at
        `positions`, encoded by the tier's codec where it has one, before any lock is taken."""
        lay, codec = self._lay, self._lay.codec
        encoded = [codec.encode(srcs[p]) for p in positions]
        raw = iter(source_pieces(srcs, [p for p, x in zip(positions, encoded) if x is None]))
        out = []
        for p, x in zip(positions, encoded):
            k = keys[p]
            key = lay.tag + bytes(k.block_hash)
            parent = b"" if k.parent is None else bytes(k.parent)
            extras = None if k.extras is None else bytes(k.extras)
            tokens = k.tokens if lay.verify_tokens else b""
            if x is None:
                pieces, keep = next(raw)
                entry = Entry(CODEC_RAW, codec.raw_layout, codec.raw_slot_bytes, 0, codec.block_bytes, 0, 0, 0,
                              parent, tokens, extras)
                out.append(Prepared(key, entry, pieces, keep))
            else:
                entry = Entry(x.codec_id, x.layout, x.slot_bytes, 0, len(x.data), 0, 0, 0, parent, tokens, extras)
                out.append(Prepared(key, entry, [np.frombuffer(x.data, dtype=np.uint8)], x.data))
        return out

    def put(self, blocks: list[Prepared], touches: list[bytes]) -> WriteOutcome:
        """Write `blocks` (eviction order) not held yet and apply `touches`, in one
        transaction (retried after clearing dead readers when the map is full). Raises
        `DiskFullError`, having written nothing, when there is no room."""
        num_bytes = sum(b.entry.slot_bytes for b in blocks)
        return self._retried(lambda attempt: self._write(blocks, touches, attempt), num_bytes)

    def _retried(self, write: Callable[[int], _T], num_bytes: int) -> _T:
        """`write(attempt)`, retried after clearing dead readers when the map is full; a want
        of room is a `DiskFullError` (the transaction rolled back)."""
        for attempt in range(4):
            try:
                return write(attempt)
            except lmdb.MapFullError:
                # A process killed inside a read transaction leaves its slot in the reader
                # table, pinning every page freed since: clear dead readers, then retry.
                self._env.reader_check()
            except OSError as exc:
                reason = self.full_reason(exc)
                if reason is None:
                    raise
                raise DiskFullError(f"disk tier at {self._path}: {reason}; nothing was written ({exc})") from exc
            except lmdb.Error as exc:
                reason = disk_full_reason(exc, self._path, num_bytes)
                if reason is not None:
                    raise DiskFullError(f"disk tier at {self._path}: {reason}; nothing was written ({exc})") from exc
                raise
        raise DiskFullError(f"disk tier at {self._path}: index map full after evicting (a reader may hold an old "
                            "snapshot); nothing was written")

    @staticmethod
    def full_reason(exc: OSError) -> str | None:
        """Why a failed file write was for want of room, or None if it was not."""
        if exc.errno == errno.EFBIG:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            return f"file size limit of {limit} bytes reached"
        return _FULL_ERRNOS.get(exc.errno or 0)

    def _write(self, blocks: list[Prepared], touches: list[bytes], extra: int) -> WriteOutcome:
        with begin(self._env, write=True) as txn:
            wb = WriteBatch(self._ix, txn)
            seq_before = wb.seq  # (as this process's in-memory index read it)
            disk_repair.settle(wb)
            wb.touch(touches)
            fresh = [b for b in blocks if wb.get(b.key) is None]  # another process may have written some
            budget = self._capacity_bytes * (1.0 - 0.15 * extra)
            costs = [block_cost(b.entry.slot_bytes) for b in fresh]
            total, skip = sum(costs), 0
            while skip < len(fresh) and total > budget:
                total -= costs[skip]  # the most evictable never enter
                skip += 1
            fresh = fresh[skip:]
            victims = wb.evict(wb.used + total - budget)
            by_size: dict[int, list[Prepared]] = {}
            for b in reversed(fresh):  # prefix order: a prefix reads forwards
                by_size.setdefault(b.entry.slot_bytes, []).append(b)
            slots = {size: wb.allocate(size, len(group)) for size, group in by_size.items()}
            self._punch(wb.unpunched())
            where: dict[bytes, tuple[int, int]] = {}
            for size, group in by_size.items():
                sums = write_payloads(self._files, size, group, slots[size])
                where.update((b.key, (s, x)) for b, s, x in zip(group, slots[size], sums))
            if fresh and self._mode is DiskSync.COMMIT:
                self._files.sync(list(by_size))
            for b in fresh:  # eviction order: the first gets the lowest tick
                wb.insert(b.key, b.entry, *where[b.key])
            disk_repair.finish(wb)
            txnid = txn.id()
        self._committed(txnid, seq_before, wb)
        return WriteOutcome(wb.added, wb.removed, len(victims))

    def remove(self, items: Sequence[tuple[bytes, int | None]], *, damaged: bool = False,
               reclaim: bool = False) -> WriteOutcome:
        """Delete entries (with a generation: only if the entry still has it). `damaged`
        entries free no slot (`WriteBatch.remove`); `reclaim` (a scrub) first sweeps every
        sub-database for damaged records (`disk_repair.sweep`) and at the end frees every slot
        no entry names. Raises `DiskFullError` (nothing changed) if the map is full."""
        return self._retried(lambda _: self._remove(items, damaged, reclaim), 0)

    def _remove(self, items: Sequence[tuple[bytes, int | None]], damaged: bool, reclaim: bool) -> WriteOutcome:
        with begin(self._env, write=True) as txn:
            wb = WriteBatch(self._ix, txn)
            seq_before = wb.seq
            disk_repair.settle(wb, full=reclaim)
            if reclaim:
                disk_repair.sweep(wb)
            for key, gen in items:
                raw = wb.get(key)
                if raw is None:
                    continue
                if gen is not None:
                    try:
                        if unpack_entry(raw).gen != gen:
                            continue  # rewritten since it was read: not the damaged one
                    except CorruptRecordError:
                        pass
                wb.remove(key, damaged=damaged)
            disk_repair.finish(wb)
            if reclaim:
                disk_repair.reclaim(wb)
            txnid = txn.id()
        self._committed(txnid, seq_before, wb)
        return WriteOutcome([], wb.removed, 0)

    def _committed(self, txnid: int, seq_before: int, wb: WriteBatch) -> None:
        self._mirror.applied(txnid, seq_before, wb.seq, wb.removed, wb.added)
        self._ix.note(wb.damage)
        if self._mode is DiskSync.COMMIT and not self._env_syncs:
            self._env.sync(True)  # another store in this process opened the index without sync
        if self._group is not None:
            self._group.mark()

    def _punch(self, freed: list[tuple[int, int]]) -> None:
        by_size: dict[int, list[int]] = {}
        for slot_bytes, slot in freed:
            by_size.setdefault(slot_bytes, []).append(slot)
        for slot_bytes, slots in by_size.items():
            slots.sort()
            spans: list[tuple[int, int]] = []
            for s in slots:
                if spans and spans[-1][0] + spans[-1][1] == s:
                    spans[-1] = (spans[-1][0], spans[-1][1] + 1)
                else:
                    spans.append((s, 1))
            self._files.punch(slot_bytes, spans)

    def sync_all(self) -> None:
        """The group commit: the data files first, then the index."""
        self._files.sync(list(self._files.file_sizes()))
        self._env.sync(True)

    def close(self) -> None:
        """Stop the group-commit thread (after its last sync)."""
        if self._group is not None:
            self._group.close()
