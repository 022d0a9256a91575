"""The disk tier's compact hash set keeps its memory of changes bounded: the dict of changed
hashes' memberships (`_view`, which also keeps changes that undid themselves) never grows
far past the merge threshold, whether merges run in place, on the owner's "thread" at once
or some changes later (as `tiers/disk/mirror.py` runs them), and over real LMDB."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.tiers.test_disk_mirror_processes import SHAPE, _open
from tiers.disk.hashset import CompactHashSet, MergeJob
from tiers.disk.tier import LMDBTier
from tiers.keys import BlockHash, BlockKey

_BATCH = 8  # fresh hashes stored then removed each round


class _Owner:
    """Runs the set's merges as the disk tier's copy does (a merge due starts one, which ends
    `lag` changes later), or in place (`lag` None); records the largest `_view` seen."""

    def __init__(self, got: CompactHashSet, lag: int | None) -> None:
        self.got, self.lag, self.peak = got, lag, 0
        got.defer_merges = lag is not None
        self.job: tuple[MergeJob, int] | None = None  # (the merge under way, changes left)

    def changed(self) -> None:
        got = self.got
        if self.job is not None:
            job, left = self.job
            self.job = (job, left - 1) if left else None
            if not left:
                assert got.finish_merge(job, job.run())
        if self.job is None and got.merge_due and (started := got.start_merge()) is not None:
            self.job = (started, self.lag or 0)
        self.peak = max(self.peak, len(got._view))


@pytest.mark.parametrize("lag", [None, 0, 5])
@pytest.mark.parametrize("undone_at_once", [False, True])
def test_churn_and_re_adds_keep_the_changes_memory_bounded(lag: int | None, undone_at_once: bool) -> None:
    """Fresh hashes stored then removed (a write evicted at once), held ones removed and stored
    again (a block rewritten), and now and then a change that lasts, forever: what the set
    remembers of changes stays within the merge threshold plus what changed while a merge ran,
    and every probe stays exact. `undone_at_once`: the owner looks only once each change has
    undone itself (as the disk tier's copy does after a transaction that removes a block and
    stores it again) and none lasts, so a merge due finds nothing to merge: the changes that
    undid themselves must be dropped all the same, or they grow without bound."""
    rng = random.Random(3)
    held = [rng.randbytes(16) for _ in range(2000)]
    got = CompactHashSet.from_keys(held, merge_min=64, merge_share=1 / 64)
    owner = _Owner(got, lag)
    want = set(held)
    for r in range(3000):
        fresh = [rng.randbytes(16) for _ in range(_BATCH)]
        again = rng.sample(held, 4)
        for change, hashes in ((got.update, fresh), (got.difference_update, fresh),
                               (got.difference_update, again), (got.update, again)):
            change(hashes)
            if not undone_at_once:
                owner.changed()
        owner.changed()
        if r % 40 == 0 and not undone_at_once:  # a change that lasts: merges have something to merge
            lasting = rng.randbytes(16)
            got.add(lasting)
            want.add(lasting)
            owner.changed()
        if r % 500 == 0:
            probe = fresh + again + rng.sample(sorted(want), 32)
            assert got.held(probe).tolist() == [h in want for h in probe]
    step = _BATCH + 4 if undone_at_once else _BATCH  # the most that changes add between two looks
    assert owner.peak <= 64 + step * (1 + (lag or 0)), owner.peak
    if undone_at_once and lag is not None:  # (in place, a merge may come between a change and its undoing)
        assert got.num_merges == 0  # every merge due found nothing to merge: the changes were dropped
    else:
        assert got.num_merges >= 2
    assert len(got) == len(want) and got.same_as(CompactHashSet.from_keys(sorted(want)))


def _settled(tier: LMDBTier) -> int:
    """How many changes `tier`'s copy remembers once the merge it may have started has ended
    (what changes while one runs, on a busy machine for long, is not counted)."""
    mirror = tier._mirror
    if mirror._merger is not None:
        mirror._merger.join(timeout=60)
    with mirror._lock:
        return len(mirror.hashes._view)


def test_over_real_lmdb_churn_leaves_the_copys_changes_bounded(tmp_path: Path) -> None:
    """Blocks stored then discarded, over and over, through the disk tier (its copy replays
    each write transaction, merges start on a thread): the copy's memory of changes stays
    within its merge threshold (4,096 changes at this size) plus a transaction's once the
    merges it started have ended."""
    batch = 64
    tier = _open(tmp_path)
    rng = random.Random(17)
    try:
        kept = [BlockHash(rng.randbytes(16)) for _ in range(50)]
        tier.put([BlockKey(h) for h in kept], [torch.zeros(SHAPE, dtype=torch.float16)] * len(kept))
        peak = 0
        for _ in range(100):  # 12,800 changes: three times the threshold
            fresh = [BlockHash(rng.randbytes(16)) for _ in range(batch)]
            tier.put([BlockKey(h) for h in fresh], [torch.zeros(SHAPE, dtype=torch.float16)] * batch)
            assert tier.match_prefix(fresh) == batch
            peak = max(peak, _settled(tier))
            tier.discard(fresh)
            assert tier.match_prefix(fresh) == 0 and tier.match_prefix(kept) == len(kept)
            peak = max(peak, _settled(tier))
        assert peak <= 4096 + 2 * batch, peak
        tier.check_integrity()
    finally:
        tier.close()
