"""The shared directory's bytes as one host sees them, and eviction without a lock.

Many hosts write the directory at once and none holds a lock another could be left holding
by dying: each host keeps its own estimate of the directory's bytes, per top-level shard
directory (`<root>/<namespace>/<aa>`), refreshed by a bounded periodic scan (at most
`scan_max_entries` files per round, resuming where the last stopped) and moved at once by
its own writes and deletions. The scan also keeps, per shard, the least recently used
blocks it saw (by mtime: a read hit `utime`s its file) and removes the temporary files of
writers older than `orphan_after_s` (a writer killed mid-file). Over capacity, a host
removes the oldest candidates, each re-`stat`ed first (one used since is skipped), down to
`target`; a file another host removed first counts as gone. Two hosts may evict at once:
the directory then drops a little below its target, never grows without bound. Only files
in kvstrata's naming scheme (`files.py`) are ever removed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from tiers.shared.forks import renew_in_child
from tiers.sharedfs import files
from tiers.sharedfs.files import Entry

_PER_SHARD = 64  # least recently used blocks kept per shard as eviction candidates


class Space:
    """One host's view of the directory's bytes and its eviction; thread-safe. `on_removed`
    is told each block this host evicted; `on_fault` each `OSError` of a scan or removal."""

    def __init__(self, root: str, capacity_bytes: int, *, scan_interval_s: float, scan_max_entries: int,
                 orphan_after_s: float, on_removed: Callable[[Entry], None],
                 on_fault: Callable[[str, OSError], None]) -> None:
        self.root, self.capacity_bytes = root, capacity_bytes
        self.target = capacity_bytes - capacity_bytes // 16  # eviction stops here
        self.scan_interval_s, self.scan_max_entries = scan_interval_s, scan_max_entries
        self.orphan_after_s = orphan_after_s
        self._on_removed, self._on_fault = on_removed, on_fault
        self._bytes: dict[str, int] = {}  # top-level shard directory -> bytes of kvstrata's files in it
        self._oldest: dict[str, list[Entry]] = {}  # shard -> its least recently used blocks seen, oldest first
        self._cursor = ""  # the last shard the previous round scanned
        self._next_scan = 0.0
        self._lock = threading.Lock()  # the two dicts
        self._busy = threading.Lock()  # one maintenance round at a time in this process
        self.num_scans = self.num_evicted = self.num_orphans_removed = 0
        renew_in_child(self, "_lock", "_busy")

    def add(self, shard: str, delta: int) -> None:
        """This host wrote (`delta` > 0) or removed bytes in `shard`."""
        with self._lock:
            self._bytes[shard] = max(0, self._bytes.get(shard, 0) + delta)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())

    def over_capacity(self) -> bool:
        return self.used_bytes() > self.capacity_bytes

    def scan_due(self) -> bool:
        return time.monotonic() >= self._next_scan

    def maintain(self, *, force_scan: bool = False) -> None:
        """Scan if a round is due (or `force_scan`), then evict if over capacity. A forced round
        waits for one another thread of this process is running, then runs its own; an
        unforced one returns at once instead."""
        if not self._busy.acquire(blocking=force_scan):
            return
        try:
            if force_scan or self.scan_due():
                self._scan()
            if self.over_capacity():
                self._evict()
        finally:
            self._busy.release()

    def scan(self, *, wait_s: float | None = None) -> bool:
        """One bounded round: list the shards, rescan them from the cursor for at most
        `scan_max_entries` files, remove orphaned temporary files. Waits for a maintenance
        round another thread of this process is running (one round at a time), at most
        `wait_s` seconds where given: past that, scans nothing and makes the next round scan.
        Returns whether it scanned."""
        if not self._busy.acquire(timeout=-1 if wait_s is None else max(0.0, wait_s)):
            self._next_scan = 0.0  # the round running may have listed before the caller's change
            return False
        try:
            self._scan()
        finally:
            self._busy.release()
        return True

    def _scan(self) -> None:
        self._next_scan = time.monotonic() + self.scan_interval_s
        self.num_scans += 1
        try:
            shards = [(path, aa) for ns in files.namespace_dirs(self.root) for path, aa in files.shard_dirs(ns)]
        except OSError as exc:
            self._on_fault("scan", exc)
            return
        present = {path for path, _ in shards}
        with self._lock:
            for gone in [s for s in self._bytes if s not in present]:
                self._bytes.pop(gone, None)
                self._oldest.pop(gone, None)
        start = next((i for i, (path, _) in enumerate(shards) if path > self._cursor), 0)
        visited = 0
        for path, aa in shards[start:] + shards[:start]:
            if visited >= self.scan_max_entries:
                break
            visited += self._scan_shard(path, aa)
            self._cursor = path

    def _scan_shard(self, path: str, aa: str) -> int:
        total, blocks, seen = 0, [], 0
        stale = time.time() - self.orphan_after_s
        try:
            for entry in files.scan_shard(path, aa):
                seen += 1
                if entry.block_hash is None and entry.mtime < stale:
                    self._remove_orphan(entry)
                    continue
                total += entry.size
                if entry.block_hash is not None:
                    blocks.append(entry)
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                self._on_fault("scan", exc)
            return seen
        blocks.sort(key=lambda e: e.mtime)
        with self._lock:
            self._bytes[path], self._oldest[path] = total, blocks[:_PER_SHARD]
        return seen

    def _remove_orphan(self, entry: Entry) -> None:
        try:
            os.unlink(entry.path)
            self.num_orphans_removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._on_fault("remove an orphaned temporary file", exc)

    def _evict(self) -> None:
        """Remove the oldest candidates until the estimate is at `target`; when candidates
        run out, one more scan round finds others (at most a few rounds per call)."""
        for _ in range(4):
            with self._lock:
                candidates = sorted(((e, shard) for shard, es in self._oldest.items() for e in es),
                                    key=lambda p: p[0].mtime)
            for entry, shard in candidates:
                if self.used_bytes() <= self.target:
                    return
                self._evict_one(entry, shard)
            if self.used_bytes() <= self.target:
                return
            self._scan()

    def _evict_one(self, entry: Entry, shard: str) -> None:
        with self._lock:
            kept = self._oldest.get(shard, [])
            if entry in kept:
                kept.remove(entry)
        try:
            st = os.stat(entry.path, follow_symlinks=False)
            if st.st_mtime > entry.mtime:  # read (or rewritten) since the scan: used, not the oldest
                return
            os.unlink(entry.path)
        except FileNotFoundError:  # another host evicted or a clear removed it
            self.add(shard, -entry.size)
            return
        except OSError as exc:
            self._on_fault("evict", exc)
            return
        self.add(shard, -entry.size)
        self.num_evicted += 1
        self._on_removed(entry)
