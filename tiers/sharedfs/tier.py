"""Shared-filesystem tier: one self-checking file per block in a directory many hosts mount
(NFS, Lustre, CephFS, 3FS, a Kubernetes RWX volume), as vLLM's `fs` offloading tier.

Files are named by their block's key under the store's namespace directory, in two levels
of 256 shard directories (`files.py`); each is a self-checking record (`tiers/shared/record.py`:
key, namespace, layout, codec, token ids, a checksum over header and payload), written to a
temporary name and renamed into place (`blockio.py`), so a reader never sees part of a
block. Capacity is kept without a lock (`space.py`): each host estimates the directory's
bytes by bounded scans and evicts the least recently used files by mtime (a read hit
`utime`s its file, at most once per `touch_after_s`).

Batched calls run on `io_threads` threads of the tier's own (shared filesystems reward
parallel requests). Every call is bounded: the caller waits at most `timeout_s` for the
tier's threads (a hung mount leaves them blocked in the kernel, not the caller); a call
that ran out of time pauses the tier for `cooldown_s` (calls are misses and dropped writes,
counted) so the next ones do not queue behind stuck threads. Every filesystem fault
(`OSError`: ENOSPC, EACCES, ESTALE, a vanished directory) is a counted miss or dropped
write with a rate-limited warning, never an exception to the caller; a damaged record is
a counted miss, removed (it is in kvstrata's naming scheme); reads stop at the first miss.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import TypeVar

import torch

from tiers.base import Occupancy, SweepResult, Tier, TierCounters, TierTraits, check_start
from tiers.changes import ChangeKind
from tiers.codecs import CodecSpec
from tiers.errors import StoreClosedError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.shared.forks import renew_in_child
from tiers.shared.ratelimit import RateLimitedWarning
from tiers.shared.record import Payload, RecordCodec
from tiers.shared.record_check import ChecksRecords, RecordCheck
from tiers.sharedfs import blockio, files
from tiers.sharedfs.clear import sweep_dirs, walk_blocks
from tiers.sharedfs.inflight import WritesInFlight
from tiers.sharedfs.space import Space

logger = logging.getLogger(__name__)

KIND = TierKind("sharedfs")
_RECORD_SLACK = 4096  # a record's header beyond the block's bytes, at most
T = TypeVar("T")


class SharedFSTier(ChecksRecords, Tier):
    """Blocks as files in a directory shared by every store (on any host) with this namespace.

    Invariant: a block returned is bit-exact with what some store put under its key (the
    record's checksum, key, namespace, layout and token ids are checked); anything else is a
    miss, and a damaged file is removed. Nothing outside kvstrata's naming scheme is ever
    removed, by eviction, clear or orphan cleanup.
    """

    kind = KIND
    traits = TierTraits(persistent=True, shared=True)

    def __init__(self, path: str, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 namespace: bytes, verify_tokens: bool = True, codec: CodecSpec | None = None,
                 io_threads: int = 8, timeout_s: float = 30.0, cooldown_s: float = 5.0,
                 touch_after_s: float = 60.0, orphan_after_s: float = 600.0, scan_interval_s: float = 10.0,
                 scan_max_entries: int = 100_000, clear_budget_s: float = 30.0, share_id: str | None = None) -> None:
        self.root = os.path.abspath(path)
        self.ns_dir = os.path.join(self.root, files.namespace_dir_name(namespace))
        os.makedirs(self.ns_dir, exist_ok=True)
        self.codec = RecordCodec(block_shape, dtype, verify_tokens=verify_tokens, namespace=namespace, codec=codec)
        self._record_bytes = self.codec.block_bytes + _RECORD_SLACK
        self._limit = 2 * self._record_bytes + (1 << 16)  # longer files are refused unread
        self.timeout_s, self.cooldown_s, self.touch_after_s = timeout_s, cooldown_s, touch_after_s
        self.clear_budget_s = clear_budget_s
        self._identity = f"sharedfs:{share_id or os.path.realpath(self.root)}"
        self.counters = TierCounters()
        self.num_write_drops = self.num_touches = self.num_timeouts = self.num_clears_incomplete = self._num_errors = 0
        self._count_lock = threading.Lock()
        self._warn_fault, self._warn_data, self._warn_drop = (RateLimitedWarning(logger) for _ in range(3))
        self._checks = RecordCheck(self.codec, self.counters, self._warn_data,
                                   where=f"shared-filesystem tier {self.root}",
                                   damaged="a damaged block file ({}); removed, a miss")
        self._paused_until = 0.0
        self._closed = False
        self._in_flight = WritesInFlight()  # a discard is never undone by a write still running
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstrata-sharedfs")
        self.io_threads = io_threads
        self.space = Space(self.root, capacity_bytes, scan_interval_s=scan_interval_s,
                           scan_max_entries=scan_max_entries, orphan_after_s=orphan_after_s,
                           on_removed=self._evicted, on_fault=self._fault)
        self._pool.submit(self.space.maintain, force_scan=True)  # the first scan, in the background
        renew_in_child(self, "_count_lock")

    def _after_fork(self) -> None:
        """In a forked child: threads of its own (the parent's do not exist here)."""
        if not self._closed:
            self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kvstrata-sharedfs")

    # -- faults ------------------------------------------------------------------------------
    @property
    def num_errors(self) -> int:
        """Filesystem faults and timed-out calls turned into misses or dropped writes."""
        return self._num_errors

    def _fault(self, what: str, exc: BaseException) -> None:
        with self._count_lock:
            self._num_errors += 1
        self._warn_fault(f"shared-filesystem tier {self.root}: {what} failed "
                         f"({type(exc).__name__}: {exc}); a miss or a dropped write")

    def _dropped(self, num: int, why: str) -> None:
        with self._count_lock:
            self.num_write_drops += num
        if num:
            self._warn_drop(f"shared-filesystem tier {self.root}: {num} block writes dropped ({why})")

    def _available(self) -> bool:
        return time.monotonic() >= self._paused_until

    def _wait(self, futures: Sequence[Future[T]], deadline: float, what: str) -> list[T | None]:
        """Each future's result in order, None where it failed (counted) or the deadline passed
        (the tier pauses for `cooldown_s`; pending work is cancelled)."""
        out: list[T | None] = []
        for i, fut in enumerate(futures):
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                for rest in futures[i:]:
                    rest.cancel()
                with self._count_lock:
                    self.num_timeouts += 1
                self._paused_until = time.monotonic() + self.cooldown_s
                self._fault(what, TimeoutError(f"no answer within {self.timeout_s:g} s; paused for "
                                               f"{self.cooldown_s:g} s"))
                return out + [None] * (len(futures) - i)
            except OSError as exc:
                self._fault(what, exc)
                out.append(None)
        return out

    def _run(self, fn: Callable[[], T], what: str) -> T | None:
        """`fn()` on the tier's threads, bounded by `timeout_s`; None if it failed (counted)."""
        return self._wait([self._pool.submit(fn)], time.monotonic() + self.timeout_s, what)[0]

    @property
    def identity(self) -> str:
        """The shared directory (`share_id` where hosts mount it at different paths)."""
        return self._identity

    # -- reads -------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return max(1, self.space.capacity_bytes // self._record_bytes)

    def __len__(self) -> int:
        return 0  # other hosts write the directory: blocks are not counted (bytes are estimated)

    def _stat_run(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if not os.path.isfile(files.block_path(self.ns_dir, h)):
                break
            n += 1
        return n

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        check_start(start)
        todo = list(block_hashes[start:])
        if not todo or not self._available():
            return 0
        step = max(8, -(-len(todo) // self.io_threads))
        runs = [todo[i : i + step] for i in range(0, len(todo), step)]
        futures = [self._pool.submit(self._stat_run, run) for run in runs]
        counts = self._wait(futures, time.monotonic() + self.timeout_s, "lookup")
        n = 0
        for run, got in zip(runs, counts):
            n += got or 0
            if got != len(run):
                break
        return n

    def _load(self, key: BlockKey) -> tuple[Payload, blockio.Read] | None:
        """Read and validate one block's file (on a tier thread); None if absent or unusable
        (counted; a damaged file removed)."""
        path = files.block_path(self.ns_dir, key.block_hash)
        try:
            got = blockio.read_file(path, self._limit)
        except blockio.TooLong as exc:
            self._checks.damaged(str(exc), partial(self._remove_damaged, path, exc.version, key.block_hash))
            return None
        if got is None:
            return None
        payload = self._checks.decode(got.data, key, partial(self._remove_damaged, path, got.version, key.block_hash))
        if payload is None:
            return None
        if blockio.touch_if_older(path, got.mtime, self.touch_after_s):
            with self._count_lock:
                self.num_touches += 1
        return payload, got

    def _remove_damaged(self, path: str, version: tuple[int, int, int, int], block_hash: BlockHash) -> None:
        """Remove a damaged block file, `path`, if it is still `version` (not rewritten since)."""
        try:
            removed = blockio.remove_version(path, version)
        except OSError as exc:
            self._fault("remove a damaged file", exc)
            return
        if removed:
            self.space.add(os.path.dirname(os.path.dirname(path)), -version[2])
            self._record(ChangeKind.LEFT, [block_hash])

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        """Read up to `2 x io_threads` files ahead in parallel, copying each into its
        destination in prefix order on the caller's thread; stop at the first miss (what is
        still queued is cancelled; nothing is written into a destination past it)."""
        if not keys or not self._available():
            return 0
        deadline = time.monotonic() + self.timeout_s
        ahead: deque[Future[tuple[Payload, blockio.Read] | None]] = deque(
            self._pool.submit(self._load, k) for k in keys[: 2 * self.io_threads])
        queued = len(ahead)
        n = 0
        try:
            while ahead:
                got = self._wait([ahead.popleft()], deadline, "read")[0]
                if got is None:
                    return n
                if queued < len(keys):
                    ahead.append(self._pool.submit(self._load, keys[queued]))
                    queued += 1
                h = keys[n].block_hash
                if not self._checks.copy_out(got[0], dsts[n], partial(
                        self._remove_damaged, files.block_path(self.ns_dir, h), got[1].version, h)):
                    return n
                n += 1
            return n
        finally:
            for rest in ahead:
                rest.cancel()

    # -- writes ------------------------------------------------------------------------------
    def _write(self, key: BlockKey, parts: Sequence[bytearray | memoryview]) -> bool:
        """Write one encoded block unless its file is there already (then only touched)."""
        path = files.block_path(self.ns_dir, key.block_hash)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            blockio.write_file(self.ns_dir, key.block_hash, parts)
            self.space.add(os.path.dirname(os.path.dirname(path)), sum(memoryview(p).nbytes for p in parts))
            return True
        blockio.touch_if_older(path, st.st_mtime, self.touch_after_s)
        return False

    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Seal each block's record (parents first: the reverse of the eviction order given)
        on the caller's thread and write it on the tier's threads; then evict if the directory
        is over capacity. A raw contiguous CPU block is written from its own memory, its
        checksum taken first (a write still running after a timeout that reads bytes changed
        since makes a record that fails its check: a miss, never other bytes); others are
        encoded into a record first. A write that fails is a counted drop; the call never
        raises for a filesystem fault."""
        if not keys:
            return 0
        if not self._available():
            self._dropped(len(keys), "the tier is paused after a call ran out of time")
            return 0
        seen: set[BlockHash] = set()
        todo, futures = [], []
        for i in range(len(keys) - 1, -1, -1):  # each write starts as soon as its block is encoded
            if keys[i].block_hash not in seen:
                seen.add(keys[i].block_hash)
                todo.append(keys[i])
                parts = self.codec.encode_parts(keys[i], srcs[i]) or (self.codec.encode(keys[i], srcs[i]),)
                futures.append(self._submit_write(keys[i], parts))
        results = self._wait(futures, time.monotonic() + self.timeout_s, "write")
        written = [key for key, ok in zip(todo, results) if ok]
        self._dropped(sum(1 for ok in results if ok is None), "filesystem faults or time out")
        self._record(ChangeKind.ENTERED, written)
        if self.space.over_capacity():  # the writer makes room (bounded by its own call's timeout)
            self._run(self.space.maintain, "eviction")
        elif self.space.scan_due():  # a periodic scan runs in the background (its faults are counted)
            self._pool.submit(self.space.maintain)
        return len(written)

    def _submit_write(self, key: BlockKey, parts: Sequence[bytearray | memoryview]) -> Future[bool]:
        """`_write` on the tier's threads, tracked until it ends (`tiers/sharedfs/inflight.py`)."""
        h = key.block_hash
        self._in_flight.start(h)
        fut = self._pool.submit(self._tracked_write, key, parts)
        fut.add_done_callback(lambda f: self._in_flight.end(h) if f.cancelled() else None)  # never ran
        return fut

    def _tracked_write(self, key: BlockKey, parts: Sequence[bytearray | memoryview]) -> bool:
        """`_write`; then, if the block was discarded meanwhile, its file removed again."""
        written = False
        try:
            written = self._write(key, parts)
            return written
        finally:
            if self._in_flight.end(key.block_hash) and written:
                self._unlink([key.block_hash])  # it never entered (its put gave up): no change

    def _unlink(self, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Remove the blocks' files (on a tier thread); those that were there."""
        gone = []
        for h in block_hashes:
            path = files.block_path(self.ns_dir, h)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            self.space.add(os.path.dirname(os.path.dirname(path)), -size)
            gone.append(h)
        return gone

    def _evicted(self, entry: files.Entry) -> None:
        with self._count_lock:
            self.counters.num_evictions += 1
        if entry.block_hash is not None and os.path.dirname(os.path.dirname(os.path.dirname(entry.path))) \
                == self.ns_dir:
            self._record(ChangeKind.LEFT, [entry.block_hash])

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Nothing: a read hit touched its file already."""

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        self._in_flight.doom(block_hashes)  # a write of one still running removes it again when it ends
        gone = self._run(lambda: self._unlink(block_hashes), "discard") if block_hashes else []
        self._record(ChangeKind.LEFT, gone or [])
        return len(gone or [])

    def held_hashes(self, limit: int = 1_000_000) -> Iterator[BlockHash]:
        """This namespace's blocks in the directory (at most `limit`, for at most
        `clear_budget_s`); what was listed before a fault (counted) otherwise."""
        self._check_open()
        found: list[BlockHash] = []
        self._run(lambda: walk_blocks(self.ns_dir, found, limit, time.monotonic() + self.clear_budget_s), "listing")
        return iter(list(found))

    def clear(self, *, all_namespaces: bool = False) -> None:
        """`sweep` (whose result says whether it finished)."""
        self.sweep(all_namespaces=all_namespaces)

    def sweep(self, *, all_namespaces: bool = False, budget_s: float | None = None) -> SweepResult:
        """Remove this namespace's block and temporary files (with `all_namespaces`, every
        namespace's under the root), and the shard directories left empty, for at most
        `budget_s` (default `clear_budget_s`). Files outside kvstrata's naming scheme stay.
        An incomplete sweep (out of time, a fault) is counted with a rate-limited warning."""
        self._check_open()
        budget = self.clear_budget_s if budget_s is None else budget_s

        def run() -> SweepResult:
            dirs = files.namespace_dirs(self.root) if all_namespaces else [self.ns_dir]
            end = time.monotonic() + budget
            swept = sweep_dirs(dirs, end, self._fault)
            # A maintenance round running (a slow directory) is waited for within the budget
            # only: the files are gone whether or not the estimate is refreshed now.
            self.space.scan(wait_s=end - time.monotonic())
            return swept

        fut = self._pool.submit(run)
        result = self._wait([fut], time.monotonic() + budget + self.timeout_s, "clear")[0] or SweepResult(0, False)
        if not result.complete:
            self.num_clears_incomplete += 1
            self._warn_data(f"shared-filesystem tier {self.root}: a clear stopped short after "
                            f"{result.num_deleted} files (out of time or a fault); the next one goes on")
        return result

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the tier's threads (those blocked in the kernel by a hung mount are left)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"shared-filesystem tier {self.root} is closed")

    def check_integrity(self) -> None:
        if self.space.used_bytes() < 0:
            raise RuntimeError("shared-filesystem tier: negative byte estimate")

    def occupancy(self) -> Occupancy:
        """This host's estimate of the directory's bytes; blocks are not counted (0)."""
        return Occupancy(0, self.capacity_blocks, self.space.used_bytes(), self.space.capacity_bytes)
