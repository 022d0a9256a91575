"""The disk tier's in-memory index merging on a thread of its own (`tiers/disk/mirror.py`),
over real LMDB: lookups never wait for a merge and stay exact while one runs; merges run one
at a time, `close` waits for the last; where no thread can be started the copy merges in
place; a copy a rebuild replaces is freed at once."""

from __future__ import annotations

import gc
import logging
import random
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.tiers.test_disk_mirror_processes import SHAPE, _open
from tiers.disk import columns
from tiers.disk.tier import LMDBTier
from tiers.keys import BlockHash, BlockKey

MERGE = "kvstrata-disk-merge"  # the merge threads' name


class HeldBack(NamedTuple):
    calls: list[str]  # the threads merges ran on
    release: threading.Event  # merges off the main thread wait for it


@pytest.fixture
def held_back(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldBack]:
    """Merges on threads other than the main one wait (up to a minute) for `release`."""
    held = HeldBack([], threading.Event())
    merged = columns.SortedColumns.merged

    def wait_then_merge(self: columns.SortedColumns, *args: object) -> columns.SortedColumns:
        held.calls.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            assert held.release.wait(timeout=60)
        return merged(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(columns.SortedColumns, "merged", wait_then_merge)
    yield held
    held.release.set()


def _put(tier: LMDBTier, rng: random.Random, n: int) -> list[BlockHash]:
    """`n` new blocks stored in `tier` (in one write transaction)."""
    hashes = [BlockHash(rng.randbytes(16)) for _ in range(n)]
    tier.put([BlockKey(h) for h in hashes], [torch.zeros(SHAPE, dtype=torch.float16)] * n)
    return hashes


def _merge_threads() -> int:
    return sum(t.name == MERGE for t in threading.enumerate())


def test_a_lookup_never_waits_for_the_in_memory_index_to_merge(tmp_path: Path, held_back: HeldBack) -> None:
    """Merging the copy's changes into its columns is O(n): 0.45 s at 10^7 blocks, about
    every 76 write transactions of 2,048 blocks (with evictions: 4,096 changes against a
    threshold of 1/32 of the set) of any process. It ran inside whichever lookup replayed the
    change that crossed the threshold. Now it runs on a thread of its own: here the merge is
    held back, and lookups go on, exact, until it ends."""
    rng = random.Random(11)
    looker, writer = _open(tmp_path), _open(tmp_path)  # (one environment, a copy each)
    try:
        first = _put(looker, rng, 5000)
        later = _put(writer, rng, 5000)  # past the copy's merge threshold
        writer.discard(first[:100])
        assert looker.match_prefix(later) == len(later)  # replays the writer's changes
        assert held_back.calls and threading.main_thread().name not in held_back.calls, held_back.calls
        assert looker.match_prefix(first) == 0 and looker.match_prefix(first, 100) == len(first) - 100
        newest = _put(writer, rng, 50)
        writer.discard(later[:10])
        assert looker.match_prefix(newest) == len(newest) and looker.match_prefix(later) == 0
        held_back.release.set()
        deadline = time.monotonic() + 60
        while looker._mirror.hashes.num_merges == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        assert looker._mirror.hashes.num_merges >= 1  # type: ignore[attr-defined]
        assert looker.match_prefix(later, 10) == len(later) - 10 and looker.match_prefix(newest) == len(newest)
        assert threading.main_thread().name not in held_back.calls
        looker.check_integrity()
    finally:
        held_back.release.set()
        writer.close()
        looker.close()


def test_merges_run_one_at_a_time_and_close_waits_for_the_last(tmp_path: Path, held_back: HeldBack) -> None:
    """A merge in place (the integrity check) supersedes the one on a thread, which runs on
    to its end all the same. A merge due meanwhile started another thread beside it (each
    holds a copy of the columns, 17 bytes a block) and `close` returned with threads still
    merging; now the next merge waits for the thread to end, and `close` for the thread."""
    rng = random.Random(5)
    tier = _open(tmp_path)
    try:
        first = _put(tier, rng, 5000)  # past the merge threshold: a merge starts, held back
        assert _merge_threads() == 1
        tier.check_integrity()  # merges in place: the held-back merge is superseded
        second = _put(tier, rng, 5000)  # past the threshold again
        assert _merge_threads() == 1
        assert tier.match_prefix(first) == len(first) and tier.match_prefix(second) == len(second)
    finally:
        threading.Timer(1.0, held_back.release.set).start()  # (after close has begun)
        tier.close()
    assert _merge_threads() == 0
    again = _open(tmp_path)
    try:
        assert again.match_prefix(first) == len(first) and again.match_prefix(second) == len(second)
        again.check_integrity()
    finally:
        again.close()


@pytest.mark.parametrize("error", [RuntimeError("can't start new thread"), MemoryError()])
def test_where_no_thread_can_be_started_the_copy_merges_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture,
                                                                 error: Exception) -> None:
    """`Thread.start` raises RuntimeError where no thread can be had (a limit on threads; at
    interpreter shutdown from Python 3.12), or MemoryError. It escaped the write that had
    committed, and the copy stayed frozen for a merge that never ran: its delta sets grew
    without bound. Now the copy merges in place from then on, counted and warned about."""
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == MERGE:
            raise error
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    rng = random.Random(3)
    tier = _open(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="tiers.disk.mirror"):
            first = _put(tier, rng, 5000)  # past the merge threshold: no thread to merge on
        hashes = tier._mirror.hashes  # type: ignore[attr-defined]
        assert tier._mirror.num_merge_failures == 1 and hashes.num_merges == 1  # type: ignore[attr-defined]
        assert "merges during lookups until it is rebuilt" in caplog.text
        second = _put(tier, rng, 5000)
        tier.discard(first[:100])
        assert hashes.num_merges == 2 and tier._mirror.num_merge_failures == 1  # type: ignore[attr-defined]
        assert tier.match_prefix(first, 100) == len(first) - 100 and tier.match_prefix(second) == len(second)
        assert tier.match_prefix(first) == 0
        tier.check_integrity()
    finally:
        tier.close()


def test_a_copy_a_rebuild_replaces_is_freed_at_once(tmp_path: Path) -> None:
    """The copy's hook for merges due held the Mirror and the copy itself: a cycle, so a copy
    a rebuild replaced (a wipe, a process idle for `LOG_KEEP` writes), and the last one once
    the tier closed, stayed in memory (O(n): 17 bytes a block) until a full garbage
    collection. Here the collector is off: both must go by reference counting alone."""
    gc.disable()
    try:
        tier = _open(tmp_path)
        _put(tier, random.Random(7), 100)
        rebuilds, old = tier.index_syncs[0], weakref.ref(tier._mirror.hashes)  # type: ignore[attr-defined]
        tier.clear(all_namespaces=True)  # a wipe: the copy is rebuilt
        assert tier.index_syncs[0] == rebuilds + 1
        assert old() is None
        last = weakref.ref(tier._mirror.hashes)  # type: ignore[attr-defined]
        tier.close()
        del tier
        assert last() is None
    finally:
        gc.enable()


def test_a_copy_being_closed_starts_no_merge_thread(tmp_path: Path) -> None:
    """A lookup already under way when `close` began could start a merge thread after
    `close` had joined the last one; a closed copy starts none (its changes stay pending)."""
    rng = random.Random(9)
    tier = _open(tmp_path)
    mirror = tier._mirror  # type: ignore[attr-defined]
    tier.close()
    tag = mirror._tag
    mirror._apply([], [tag + rng.randbytes(16) for _ in range(5000)])  # past the merge threshold
    assert mirror.hashes.merge_due and _merge_threads() == 0 and mirror.num_merge_failures == 0
