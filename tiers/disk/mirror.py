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

The copy's merges (O(n): 0.45 s at 10^7 blocks, every 8 (10^6 blocks) to 76 (10^7) write
transactions of 2,048 blocks with evictions, of any process) run on a thread of their own
(`_merge`), one at a time, holding the lock only to start and to put the new columns in
place: a lookup that replays a change never waits for one. `close` waits for the last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from itertools import compress

import lmdb
import numpy as np

from tiers.disk.env import begin
from tiers.disk.hashset import CompactHashSet, MergeJob
from tiers.disk.index import Index
from tiers.keys import BlockHash
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)
_MERGE_NICE = 10  # added to the merge thread's nice value
_CLOSE_WAIT_S = 60.0  # the longest `close` waits for a merge (a thread stopped at interpreter exit never ends)


def untagged(keys: list[bytes], tag: bytes) -> list[bytes]:
    """The hashes of those index `keys` (a namespace's tag, then a hash) under `tag`: one
    pass of array work where every key has one length (a log record's keys do)."""
    n = len(tag)
    size = len(keys[0]) if keys else 0
    joined = b"".join(keys)
    if size <= n or len(joined) != size * len(keys) or max(map(len, keys)) != size:
        return [key[n:] for key in keys if key[:n] == tag]
    rows = np.frombuffer(joined, np.uint8).reshape(len(keys), size)
    ours = rows[(rows[:, :n] == np.frombuffer(tag, np.uint8)).all(axis=1), n:]
    hashes: list[bytes] = np.ascontiguousarray(ours).view(f"V{size - n}").ravel().tolist()
    return hashes


class Mirror:
    """The hashes of one namespace (by index tag) held in a disk tier; thread-safe."""

    def __init__(self, env: lmdb.Environment, index: Index, tag: bytes) -> None:
        self._env, self._index, self._tag = env, index, tag
        self._seq = -1  # log position applied; -1: never built
        self._txnid = -1  # LMDB transaction id seen at the last refresh
        self._lock = threading.Lock()
        self.num_rebuilds = 0
        self.num_replayed = 0
        self.num_merge_failures = 0
        self._merger: threading.Thread | None = None  # the thread of the last merge started
        self._closed = False  # no merge thread starts once `close` began
        self._warn = RateLimitedWarning(logger)
        self.hashes = self._deferring(CompactHashSet())

    @staticmethod
    def _deferring(hashes: CompactHashSet) -> CompactHashSet:
        """`hashes`, its merges left to this copy (`_apply` starts them)."""
        hashes.defer_merges = True
        return hashes

    def _start_merge(self) -> None:
        """(The lock held.) Freeze the copy's changes and merge them into its columns on a
        thread of its own; one at a time (while an earlier one, superseded, still runs, the
        merge waits for the next change). Where no thread can be started, merge here."""
        if self._closed or (self._merger is not None and self._merger.is_alive()):
            return
        hashes = self.hashes
        job = hashes.start_merge()
        if job is None:
            return
        merger = threading.Thread(target=self._merge, args=(hashes, job), name="kvstrata-disk-merge", daemon=True)
        try:
            merger.start()
        except Exception as exc:  # RuntimeError "can't start new thread" (a limit, interpreter shutdown), MemoryError
            self._merge_in_place(hashes, job, exc)
            hashes.merge()
            return
        self._merger = merger

    def _merge(self, hashes: CompactHashSet, job: MergeJob) -> None:
        """Build the merged columns without the lock, at a low CPU priority (lookups and
        writes first), then put them in place."""
        with contextlib.suppress(OSError, AttributeError):  # (Linux: a thread's own nice value)
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _MERGE_NICE))
        try:
            merged = job.run()
        except Exception as exc:  # MemoryError at most: the job only reads arrays and sets
            with self._lock:
                self._merge_in_place(hashes, job, exc)
            return
        with self._lock:
            hashes.finish_merge(job, merged)

    def _merge_in_place(self, hashes: CompactHashSet, job: MergeJob, exc: BaseException) -> None:
        """(The lock held.) `job` failed or found no thread: its changes return to `hashes`'
        delta sets, and `hashes` merges during lookups from now on (a rebuilt copy tries threads
        again); counted and warned about."""
        hashes.abandon_merge(job)
        hashes.defer_merges = False
        self.num_merge_failures += 1
        self._warn(f"disk tier: merging the in-memory index on a thread failed ({exc!r}); it merges during "
                   "lookups until it is rebuilt")

    def close(self) -> None:
        """Wait (up to a minute: 0.45 s at 10^7 blocks) for a merge under way to end: its
        thread holds the old columns and the new."""
        with self._lock:  # (a lookup under way may not start a thread after the join)
            self._closed = True
            merger = self._merger
        if merger is not None:
            merger.join(timeout=_CLOSE_WAIT_S)

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
        self.hashes = self._deferring(self._index.hashes_of(txn, self._tag))
        self.num_rebuilds += 1

    def _apply(self, removed: list[bytes], added: list[bytes]) -> None:
        self.hashes.difference_update(untagged(removed, self._tag))
        self.hashes.update(untagged(added, self._tag))
        if self.hashes.merge_due:
            self._start_merge()

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
