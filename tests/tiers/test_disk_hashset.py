"""The disk tier's compact hash set (`tiers/disk/hashset.py`) against a Python set: any
sequence of adds, removals, probes, merges and rebuilds answers as the set does."""

from __future__ import annotations

import os
import random
import sys
import types
from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.disk import columns, hashset
from tiers.disk.hashset import CompactHashSet, MergeJob

# 16-byte hashes sharing their first 8 bytes often (the probe's tie path), random ones,
# 32-byte ones (sha256) and lengths no column holds.
_HASHES = st.one_of(
    st.builds(lambda a, b: bytes([a]) * 8 + bytes([b]) * 8, st.integers(0, 3), st.integers(0, 255)),
    st.builds(lambda a, b: bytes([a]) * 7 + bytes([b]) * 9, st.integers(0, 3), st.integers(0, 3)),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=0, max_size=40),
)
_OPS = st.lists(st.tuples(st.sampled_from(["add", "discard", "update", "difference_update", "contains", "held",
                                           "count_prefix", "merge", "rebuild", "iter", "start", "finish",
                                           "abandon", "stale"]),
                          st.lists(_HASHES, max_size=12), st.integers(0, 14)), max_size=60)


def _same(got: CompactHashSet, want: set[bytes], probe: Sequence[bytes] = ()) -> None:
    """`got` holds `want`: its length, its iteration, its probes of every held hash and of
    `probe`, and its dict of changed hashes' memberships."""
    assert len(got) == len(want)
    listed = list(got)
    assert len(listed) == len(want) and set(listed) == want
    every = sorted(want) + list(probe)
    assert got.held(every).tolist() == [h in want for h in every]
    assert all((h in got) == (h in want) for h in every)
    # the dict a probe reads first names every hash of the delta sets, and each it names
    # (also those no probe above asks about) with its true membership
    view = got._view
    assert all(held == (h in want) for h, held in view.items())
    assert all(h in view for s in (got._added, got._removed, got._frozen_added, got._frozen_removed) for h in s)


class _Jobs:
    """Merges started and not yet ended, as the disk tier's copy runs them: each job's columns
    are built at once (its thread then waits for the lock) or when it ends, and must come out
    the same (nothing the job reads changes meanwhile). Jobs that ended or were superseded
    are kept: one ended again ("stale", a thread late by any number of merges) changes nothing."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pending: list[tuple[MergeJob, columns.SortedColumns | None]] = []  # (a job, its columns if built)
        self.ended: list[MergeJob] = []

    def do(self, target: CompactHashSet, op: str) -> None:
        """`op` on `target`: "start" a merge, "finish" or "abandon" a pending one, or "merge" in
        place (which supersedes every pending one)."""
        if op == "start" and (job := target.start_merge()) is not None:
            assert target.start_merge() is None  # one at a time
            self.pending.append((job, job.run() if self.rng.random() < 0.5 else None))
        elif op == "merge":
            target.merge()
            assert not any(target.finish_merge(j, j.run()) for j, _ in self.pending)  # superseded
            self.ended += [j for j, _ in self.pending]
            self.pending.clear()
        elif op == "stale" and self.ended:
            job = self.rng.choice(self.ended)
            assert not target.finish_merge(job, job.run())
            target.abandon_merge(job)
        elif op in ("finish", "abandon") and self.pending:
            job, built = self.pending.pop(self.rng.randrange(len(self.pending)))
            self.ended.append(job)
            late = job.run()
            assert built is None or late.same_rows(built)
            if op == "finish":
                target.finish_merge(job, late if built is None else built)
            else:
                target.abandon_merge(job)


@given(initial=st.lists(_HASHES, max_size=40), ops=_OPS, merge_min=st.integers(0, 6),
       merge_share=st.sampled_from([0.0, 0.1, 1.0]), tagged=st.booleans(), seed=st.integers(0, 2**16),
       deferred=st.booleans())
@settings(max_examples=500, deadline=None)
def test_matches_a_python_set(initial: list[bytes], ops: list[tuple[str, list[bytes], int]], merge_min: int,
                              merge_share: float, tagged: bool, seed: int, deferred: bool) -> None:
    """`deferred`: merges run as the disk tier's copy runs them, later (`start_merge`, then
    `finish_merge` or `abandon_merge` after more changes, or superseded by `merge` or a
    rewidening); a job's columns are built at once (its thread then waits for the lock) or
    when it finishes, and must come out the same: nothing it reads changes meanwhile."""
    rng = random.Random(seed)
    jobs = _Jobs(rng)
    tag = b"T" * 8 if tagged else b""
    keys = [tag + h for h in initial]
    rng.shuffle(keys)
    got = CompactHashSet.from_keys(keys, skip=len(tag), merge_min=merge_min, merge_share=merge_share)
    got.defer_merges = deferred
    want = set(initial)
    _same(got, want)
    for op, hs, start in ops:
        probe = hs + rng.sample(sorted(want), min(len(want), 4))  # some held ones too
        rng.shuffle(probe)
        if op == "add" and hs:
            got.add(hs[0])
            want.add(hs[0])
        elif op == "discard" and probe:
            got.discard(probe[0])
            want.discard(probe[0])
        elif op == "update":
            got.update(hs)
            want.update(hs)
        elif op == "difference_update":
            got.difference_update(probe)
            want.difference_update(probe)
        elif op == "contains":
            assert all((h in got) == (h in want) for h in probe)
        elif op == "held":
            assert got.held(probe).tolist() == [h in want for h in probe]
        elif op == "count_prefix":
            run = sorted(want, key=lambda h: rng.random())[:start] + probe
            n = start
            expect = 0
            while n + expect < len(run) and run[n + expect] in want:
                expect += 1
            assert got.count_prefix(run, n) == expect
        elif op in ("merge", "start", "finish", "abandon", "stale"):
            jobs.do(got, op)
        elif op == "rebuild":
            rebuilt = CompactHashSet.from_keys(sorted(tag + h for h in want), skip=len(tag))
            assert rebuilt.same_as(got) and got.same_as(rebuilt)
            got = rebuilt
            jobs.pending.clear()
            jobs.ended.clear()  # (jobs of the set replaced)
            got.defer_merges = deferred
        if deferred and got.merge_due:
            jobs.do(got, "start")
        _same(got, want, hs)
    other = CompactHashSet.from_keys(list(want) + [b"\x00" * 16] * 2)
    assert other.same_as(got) == (b"\x00" * 16 in want)


# Few hashes, so that changes while a merge is under way often touch those it froze (a
# removal undone, an addition removed again); two widths whose counts cross (a rewidening
# supersedes the job), sharing leading words (the probe's tie path); lengths no column holds.
_FEW = [bytes([i % 2]) * 8 + bytes([i]) * 8 for i in range(5)] + [bytes([i]) * 24 + b"w" * 8 for i in range(5)] + [b"s"]
_FEW_OPS = st.lists(st.tuples(st.sampled_from(["update", "difference_update", "start", "finish", "abandon", "merge",
                                                            "stale"]),
                              st.lists(st.sampled_from(_FEW), max_size=4)), min_size=10, max_size=80)


@given(initial=st.lists(st.sampled_from(_FEW), max_size=12), ops=_FEW_OPS, merge_min=st.integers(0, 3),
       seed=st.integers(0, 2**16))
@settings(max_examples=300, deadline=None)
def test_merges_under_way_over_few_hashes_match_a_python_set(initial: list[bytes], ops: list[tuple[str, list[bytes]]],
                                                            merge_min: int, seed: int) -> None:
    """Every change, probe, start, finish, abandon and merge in place while merges are under
    way, over few hashes: the set answers as a Python set does after each step."""
    jobs = _Jobs(random.Random(seed))
    got = CompactHashSet.from_keys(initial, merge_min=merge_min, merge_share=0.1)
    got.defer_merges = True
    want = set(initial)
    for op, hs in ops:
        if op in ("update", "difference_update"):
            getattr(got, op)(hs)
            getattr(want, op)(hs)
        else:
            jobs.do(got, op)
        if got.merge_due:
            jobs.do(got, "start")
        _same(got, want)
        assert got.held(_FEW).tolist() == [h in want for h in _FEW] and all((h in got) == (h in want) for h in _FEW)


def test_a_merge_a_rewidening_superseded_never_lands() -> None:
    """A rewidening rebuilds the set's columns at another width and supersedes the merge under
    way; a merge started after it must not take the superseded one's generation, or the
    old job's columns (of the old width, without the later changes) would be put in place."""
    narrow, wide = [bytes([i]) * 16 for i in range(3)], [bytes([i]) * 32 for i in range(6)]
    got = CompactHashSet.from_keys(narrow[:2], merge_min=0)
    got.defer_merges = True
    got.add(narrow[2])
    first = got.start_merge()
    got.update(wide[:5])  # more hashes of another width than in the columns: a rewidening
    assert first is not None and got.width == 32 and not got.merge_due
    got.add(wide[5])
    second = got.start_merge()
    assert second is not None and not got.finish_merge(first, first.run()) and got.finish_merge(second, second.run())
    _same(got, set(narrow + wide))


def test_a_long_prompt_and_a_large_set_probe_vectorized_and_merge_amortized() -> None:
    """10^5 hashes: a 4,096-block prompt whose 3,000th block is missing counts 3,000; stores
    and removals of a tenth of the set merge a bounded number of times."""
    raw = np.random.default_rng(7).bytes(16 * 100_000)
    hashes = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    got = CompactHashSet.from_keys(sorted(hashes))
    assert got.num_merges == 0 and len(got) == 100_000
    prompt = hashes[:4096]
    prompt[3000] = os.urandom(16)
    assert got.count_prefix(prompt) == 3000 and got.count_prefix(prompt, 3001) == 4096 - 3001
    new = [os.urandom(16) for _ in range(10_000)]
    for i in range(0, 10_000, 100):  # as write transactions do: removals, then stores
        got.difference_update(hashes[i : i + 100])
        got.update(new[i : i + 100])
    assert 1 <= got.num_merges <= 4  # merged past a share of the set, not per change
    assert got.same_as(CompactHashSet.from_keys(hashes[10_000:] + new))
    assert got.count_prefix(new) == len(new) and got.count_prefix(hashes[:5]) == 0


def test_a_stray_key_of_another_valid_width_does_not_decide_the_columns_width() -> None:
    """A damaged index key of 8 (or 24) bytes sorting first made the columns 8 bytes wide and
    every real 16-byte hash went to the plain set (the compact index lost, silently): the
    width is the most common length, in a build and in the first stores alike."""
    real = sorted(os.urandom(16) for _ in range(100))
    tag = b"ns"
    for stray in (b"\x00" * 8, b"\x00" * 24):
        got = CompactHashSet.from_keys([tag + stray] + [tag + h for h in real], skip=len(tag))
        assert got.width == 16 and len(got) == 101
        assert got.held([stray, *real]).all() and got.count_prefix(real) == 100
        fresh = CompactHashSet()
        fresh.update([stray, *real[:10]])
        assert fresh.width == 16 and stray in fresh and fresh.count_prefix(real[:10]) == 10


def test_empty_sets_of_one_width_compare_equal_with_or_without_columns() -> None:
    """A set emptied before any merge (no columns) against one emptied by a merge (empty
    columns): `same_as` raised ValueError from zip(strict=True)."""
    h = b"\x01" * 16
    never_merged = CompactHashSet()
    never_merged.add(h)
    never_merged.discard(h)
    merged = CompactHashSet.from_keys([h])
    merged.discard(h)
    merged.merge()
    assert never_merged.same_as(merged) and merged.same_as(never_merged)


def _skewed(rng: random.Random, kind: int, width: int) -> bytes:
    """Hashes that crowd one directory bucket, sit at the ends of the order, share their
    leading word or differ only in the last byte."""
    if kind == 0:
        return rng.randbytes(width)
    if kind == 1:
        return bytes([rng.choice((0, 255))]) * (width - 1) + bytes([rng.randrange(256)])
    if kind == 2:
        return b"\xff" * 8 + rng.randbytes(width - 8)
    if kind == 3:
        return bytes([rng.randrange(256)]) + bytes(width - 2) + bytes([rng.randrange(4)])
    if kind == 4:
        return rng.randbytes(2) + b"\xff" * (width - 2)
    return rng.randbytes(rng.choice((0, 8, 15, 17, 24, 32)))


@given(seed=st.integers(0, 2**32), width=st.sampled_from([8, 16, 32]),
       kinds=st.sets(st.integers(0, 5), min_size=1, max_size=3), size=st.sampled_from([1, 50, 600, 3000]),
       merge_min=st.sampled_from([0, 1, 64]), merge_share=st.sampled_from([0.0, 1 / 32, 0.5]))
@settings(max_examples=60, deadline=None)
def test_large_skewed_sets_match_a_python_set(seed: int, width: int, kinds: set[int], size: int, merge_min: int,
                                              merge_share: float) -> None:
    """Sets large enough for a many-bucket directory, with buckets far over their share
    (the probe's window), builds from LMDB order and from any order, merges at every
    threshold: membership, prefix counts from any start, listing and equality as a set's."""
    rng = random.Random(seed)
    pool = sorted({_skewed(rng, rng.choice(sorted(kinds)), width) for _ in range(size)})
    want = set(rng.sample(pool, rng.randrange(len(pool) + 1)))
    keys = [b"ns" + h for h in want]
    if rng.random() < 0.5:
        keys.sort()
    got = CompactHashSet.from_keys(keys, skip=2, size_hint=rng.choice([0, len(keys)]), merge_min=merge_min,
                                   merge_share=merge_share)
    for _ in range(12):
        batch = [rng.choice(pool) for _ in range(rng.randrange(1, 80))]
        if rng.random() < 0.5:
            got.update(batch)
            want.update(batch)
        else:
            got.difference_update(batch)
            want.difference_update(batch)
        probe = rng.sample(pool, min(len(pool), 60))
        assert got.held(probe).tolist() == [h in want for h in probe]
        start = rng.randrange(20)
        n = start
        while n < len(probe) and probe[n] in want:
            n += 1
        assert got.count_prefix(probe, start) == max(0, n - start)
        assert len(got) == len(want)
    assert set(got) == want
    assert got.same_as(CompactHashSet.from_keys(sorted(want)))


def test_a_probe_among_many_hashes_sharing_their_leading_word_is_a_search_not_a_walk() -> None:
    """Hashes whose first 8 bytes are equal (an unkeyed xxh3-128 with a public seed does not
    rule out crafted ones): a probe walked the rows sharing that word one at a time, so a
    2,048-block lookup among 20,000 such hashes took 12 s of CPU. Counted in lines of Python
    run (not time): a probe runs a bounded number, however many rows share the word."""
    rng = random.Random(5)
    shared = sorted(b"\xab" * 8 + rng.randbytes(8) for _ in range(4000))
    got = CompactHashSet.from_keys(shared)
    present = shared[::125]
    absent = [b"\xab" * 8 + rng.randbytes(8) for _ in range(32)]
    lines = 0

    def count(frame: types.FrameType, event: str, arg: object) -> object:
        nonlocal lines
        if event == "line" and frame.f_code.co_filename in (hashset.__file__, columns.__file__):
            lines += 1
        return count

    before = sys.gettrace()
    sys.settrace(count)
    try:
        mask = got.held(present + absent)
        prefix = got.count_prefix(present)
    finally:
        sys.settrace(before)
    assert mask.tolist() == [True] * len(present) + [h in set(shared) for h in absent]
    assert prefix == len(present)
    assert lines < 100 * (len(present) * 2 + len(absent)), lines  # a walk: ~2,000 rows a probe
    got.update(absent)
    assert got.same_as(CompactHashSet.from_keys(shared + absent))


def test_a_width_taken_from_a_stray_key_gives_way_once_real_hashes_outnumber_it() -> None:
    """A copy built from an index holding only a damaged 8-byte key took width 8, and every
    16-byte hash stored after it went to the plain set for the life of the process. Once
    hashes of one valid length outnumber the columns' (counted each time the plain set
    doubles), the columns take that length."""
    rng = random.Random(9)
    got = CompactHashSet.from_keys([b"ns" + b"\x00" * 8], skip=2, merge_min=16)
    want = {b"\x00" * 8}
    for _ in range(20):
        batch = [rng.randbytes(16) for _ in range(10)] + [rng.randbytes(5)]
        got.update(batch)
        want.update(batch)
        gone = rng.sample(sorted(want), 3)
        got.difference_update(gone)
        want.difference_update(gone)
        assert len(got) == len(want) and got.held(sorted(want)).all()
    assert got.width == 16 and set(got) == want
    assert got.same_as(CompactHashSet.from_keys(sorted(want), width=16))
