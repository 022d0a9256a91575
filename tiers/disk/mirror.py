"""This process's copy of the block hashes one namespace holds on disk: lookups probe it.

The copy is a `CompactHashSet` (`tiers/disk/hashset.py`: sorted 16-byte hashes in NumPy
columns, about 18 bytes per block, probed a whole prompt at a time).

Built from the index when the tier opens, then kept in step with every process sharing the
directory: each write transaction logs the keys it removed and added (`tiers/disk/index.py`),
and `refresh()` first compares LMDB's last transaction id (read without a transaction, about
a microsecond) with the one it saw last; only when another transaction committed does it
replay the log records since its own position, or rebuild from the index if the log no
longer reaches back that far (a process idle for more than `LOG_KEEP` writes, or a wipe).

Invariant: after `refresh()`, `hashes` equals this namespace's keys in the index as of a
snapshot no older than the call. Every use of `hashes` holds the lock (the compact set is
not thread-safe). A hash wrongly held would only send a read to the index, which finds no
entry (a miss); `check()` holds the copy exactly equal to the index all the same.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import compress

import lmdb

from tiers.disk.env import begin
from tiers.disk.hashset import CompactHashSet
from tiers.disk.index import Index
from tiers.keys import BlockHash


class Mirror:
    """The hashes of one namespace (by index tag) held in a disk tier; thread-safe."""

    def __init__(self, env: lmdb.Environment, index: Index, tag: bytes) -> None:
        self.hashes = CompactHashSet()
        self._env, self._index, self._tag = env, index, tag
        self._seq = -1  # log position applied; -1: never built
        self._txnid = -1  # LMDB transaction id seen at the last refresh
        self._lock = threading.Lock()
        self.num_rebuilds = 0
        self.num_replayed = 0

    def refresh(self) -> None:
        """Catch up with every transaction committed before this call."""
        txnid = self._env.info()["last_txnid"]
        if txnid == self._txnid:
            return
        with self._lock, begin(self._env) as txn:
            self._catch_up(txn)
            self._txnid = max(self._txnid, txnid)

    def _catch_up(self, txn: lmdb.Transaction) -> None:
        seq = self._index.get_u64(txn, b"seq")
        if seq == self._seq:
            return
        records = self._index.log_since(txn, self._seq) if 0 <= self._seq < seq else None
        if records is None or len(records) != seq - self._seq:
            self._rebuild(txn)
        else:
            for removed, added in records:
                self._apply(removed, added)
            self.num_replayed += len(records)
        self._seq = seq

    def _rebuild(self, txn: lmdb.Transaction) -> None:
        self.hashes = self._index.hashes_of(txn, self._tag)
        self.num_rebuilds += 1

    def _apply(self, removed: list[bytes], added: list[bytes]) -> None:
        tag, n = self._tag, len(self._tag)
        self.hashes.difference_update(key[n:] for key in removed if key[:n] == tag)
        self.hashes.update(key[n:] for key in added if key[:n] == tag)

    def applied(self, txnid: int, seq_before: int, seq_after: int, removed: list[bytes],
                added: list[bytes]) -> None:
        """This process committed transaction `txnid`, which moved the log from `seq_before`
        to `seq_after`: apply it directly when this copy was current before it (else the next
        `refresh` replays it with the others)."""
        with self._lock:
            if self._seq == seq_before:
                self._apply(removed, added)
                self._seq = seq_after
                self._txnid = max(self._txnid, txnid)

    def count_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        """How many consecutive `block_hashes[start:]` are held (current as of this call)."""
        self.refresh()
        with self._lock:
            return self.hashes.count_prefix(block_hashes, start)

    def held(self, block_hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Those of `block_hashes` held (current as of this call)."""
        self.refresh()
        with self._lock:
            return set(compress(block_hashes, self.hashes.held(block_hashes)))

    def snapshot(self) -> list[BlockHash]:
        self.refresh()
        with self._lock:
            return list(map(BlockHash, self.hashes))

    def check(self, txn: lmdb.Transaction) -> None:
        """Raise `RuntimeError` (a bug) unless this copy, brought to `txn`'s snapshot, equals
        the namespace's keys in it. Skipped when this copy is already past that snapshot."""
        with self._lock:
            if self._index.get_u64(txn, b"seq") < self._seq:
                return
            self._catch_up(txn)
            held = self._index.hashes_of(txn, self._tag)
            if not held.same_as(self.hashes):
                raise RuntimeError(f"disk tier: in-memory index has {len(self.hashes)} blocks, the index "
                                   f"{len(held)} (a bug)")
