"""A compact set of block hashes: sorted NumPy columns, small delta sets, vectorized probes.

The disk tier keeps one in every process (`tiers/disk/mirror.py`). Hashes of the set's width
(the most common length among the first it holds: 16 bytes for xxh3-128, 32 for sha256; a
multiple of 8; a stray damaged key does not decide it, and gives way where it did) are
held in a `SortedColumns` (`tiers/disk/columns.py`: sorted uint64 columns, in byte order, the
order LMDB's cursor yields them, so a build from the index sorts nothing; about 17 bytes per
block at width 16). Stores and removals go to two small Python sets (`_added`: not in the
columns, `_removed`: in them), merged into new columns once they exceed `merge_share` of
them, so a change costs O(1) amortized. A dict (`_view`) holds the membership of every hash
those sets (or the frozen ones below) name, so a probe looks each hash up once however many
sets there are. Hashes of any other length sit in a plain set (`_other`).

A merge is O(n) (0.45 s at 10^7 hashes). Where `defer_merges` is set, a merge due waits
for the owner (`merge_due`), who runs it on another thread (`start_merge`, then
`MergeJob.run` without the lock, then `finish_merge`). Meanwhile the deltas being merged are
frozen (`_frozen_added`, `_frozen_removed`) and new changes go to fresh ones, so probes and
changes go on against the old columns and the frozen deltas, and once the new columns are in
place the fresh deltas are already relative to them.

Probes take a whole prompt's hashes at once (`held`, `count_prefix`): one `b"".join`, one
`np.frombuffer` and a few array operations, however many blocks. Not thread-safe: the
caller holds a lock (a `MergeJob.run` needs none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, islice, repeat
from typing import NamedTuple

import numpy as np

from tiers.base import check_start
from tiers.disk.columns import Column, Mask, SortedColumns, cols_of, in_order, sorted_unique, split

_CHUNK = 1 << 10  # keys joined at once by a build (its buffers stay below malloc's mmap threshold)
_FIRST_PROBE = 16  # count_prefix probes this many first (an early miss is cheap), then the rest


def _valid_width(width: int) -> bool:
    return 8 <= width <= 64 and width % 8 == 0


def _common_width(items: Iterable[bytes], skip: int = 0) -> tuple[int | None, int]:
    """(the most common column width among the lengths of `items` less `skip`, None if none
    is one; how many have it), counted in C, no Python code per item: a stray key of another
    valid width (a damaged index key, 8 or 24 bytes) must not set the width and leave every
    real hash in the plain set."""
    counts = {n - skip: c for n, c in Counter(map(len, items)).items() if _valid_width(n - skip)}
    width = max(counts, key=counts.__getitem__) if counts else None
    return width, counts.get(width, 0) if width is not None else 0


class MergeJob(NamedTuple):
    """A merge started by `start_merge`: `run()` builds the new columns from what it holds,
    which nothing changes meanwhile, so it needs no lock."""

    generation: int
    base: SortedColumns
    width: int
    added: set[bytes]
    removed: set[bytes]

    def run(self) -> SortedColumns:
        return self.base.merged(self.width, self.added, self.removed)


class CompactHashSet:
    """A set of `bytes` (block hashes); `merge_share` and `merge_min` decide when the delta
    sets are merged into the sorted columns (past `max(merge_min, merge_share * len)`)."""

    def __init__(self, *, merge_share: float = 1 / 32, merge_min: int = 4096) -> None:
        self._width: int | None = None
        self._base = SortedColumns([])
        # `_added`/`_removed` are relative to the columns less `_frozen_removed` plus
        # `_frozen_added`; the frozen sets are empty unless a merge is under way
        self._added: set[bytes] = set()
        self._removed: set[bytes] = set()
        self._frozen_added: set[bytes] = set()
        self._frozen_removed: set[bytes] = set()
        # membership of every hash the four sets name, and of some whose change undid itself
        # (a hash of the width it does not name is held if in the columns)
        self._view: dict[bytes, bool] = {}
        self._merging = 0  # the generation of the merge under way; 0: none
        self._generation = 0
        self._other: set[bytes] = set()
        self._merge_share, self._merge_min = merge_share, merge_min
        self._other_seen = 0  # the plain set's size when its widths were last counted
        self.num_merges = 0
        # True: a merge due waits for the owner (`merge_due`, `start_merge`); a flag, not a hook
        # calling the owner, which would make a cycle (owner, set, hook) that keeps a replaced
        # set's columns in memory until a full garbage collection
        self.defer_merges = False

    # -- building -----------------------------------------------------------------------
    @classmethod
    def from_keys(cls, keys: Iterable[bytes], skip: int = 0, *, size_hint: int = 0, merge_share: float = 1 / 32,
                  merge_min: int = 4096, width: int | None = None) -> CompactHashSet:
        """The hashes `key[skip:]` of `keys` (any order, duplicates allowed), in one pass that
        runs Python code per chunk of keys, not per key. `size_hint`: about how many there
        are (at least: the columns are allocated once, then cut to size; no large buffer is
        freed on the way, which glibc would keep in the heap as resident memory). `width`:
        the columns' (else the most common valid length of the first keys)."""
        self = cls(merge_share=merge_share, merge_min=merge_min)
        self._width = width if width is not None and _valid_width(width) else None
        cols: list[Column] = []
        n, it = 0, iter(keys)
        while chunk := list(islice(it, _CHUNK)):
            if self._width is None:
                self._width = _common_width(chunk, skip)[0]
            if self._width is None:
                self._other.update(k[skip:] for k in chunk)
                continue
            if not cols:
                cols = [np.empty(max(size_hint, len(chunk)), np.uint64) for _ in range(self._width // 8)]
            size = skip + self._width
            if set(map(len, chunk)) != {size}:  # (mixed widths: rare)
                self._other.update(k[skip:] for k in chunk if len(k) != size)
                chunk = [k for k in chunk if len(k) == size]
            if n + len(chunk) > len(cols[0]):  # (more than the hint)
                cols = [np.concatenate((c[:n], np.empty(max(n, len(chunk)), np.uint64))) for c in cols]
            words = np.frombuffer(b"".join(chunk), np.uint8).reshape(len(chunk), size)[:, skip:].view(">u8")
            for i, c in enumerate(cols):
                c[n : n + len(chunk)] = words[:, i]
            n += len(chunk)
        for c in cols:
            c.resize(n, refcheck=False)  # (in place: the tail given back)
        if n:
            self._base = SortedColumns(cols if in_order(cols) else sorted_unique(cols))
        return self

    @property
    def width(self) -> int | None:
        """The length of the hashes held in the columns (None until one is held)."""
        return self._width

    # -- probes -------------------------------------------------------------------------
    def _in_base(self, hashes: Sequence[bytes]) -> Mask:
        """Whether each of `hashes` (all of the set's width) is in the columns less
        `_frozen_removed` plus `_frozen_added` (what `_added`/`_removed` are relative to)."""
        assert self._width is not None
        found = self._base.find(cols_of(hashes, self._width))[1]
        for members, held in ((self._frozen_removed, False), (self._frozen_added, True)):
            if members:
                mask = np.fromiter(map(members.__contains__, hashes), np.bool_, len(hashes))
                found = found | mask if held else found & ~mask
        return found

    def _changed(self, hashes: Sequence[bytes], found: Mask) -> Mask:
        """`found` (each of `hashes` in the columns) with every change since the columns were
        built applied over it (`_view`)."""
        if not self._view:
            return found
        known = np.fromiter(map(self._view.get, hashes, repeat(2)), np.int8, len(hashes))
        return np.where(known == 2, found, known == 1)

    def held(self, hashes: Sequence[bytes]) -> Mask:
        """Whether each of `hashes` is in the set, vectorized."""
        n = len(hashes)
        if not n:
            return np.zeros(0, np.bool_)
        joined = b"".join(hashes)
        if len(joined) != n * (self._width or 0) or max(map(len, hashes)) != self._width:  # (mixed: rare)
            return np.fromiter(map(self.__contains__, hashes), np.bool_, n)
        found = self._base.find(split(np.frombuffer(joined, np.uint8).reshape(n, len(joined) // n)))[1]
        return self._changed(hashes, found)

    def count_prefix(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """How many consecutive `hashes[start:]` are in the set: the first 16 probed, then the
        rest at once, so a prompt missing early costs one small probe."""
        check_start(start)
        i, end = start, len(hashes)
        for stop in (start + _FIRST_PROBE, end):
            if i >= end:
                break
            mask = self.held(hashes[i:stop])
            if not mask.all():
                return i - start + int(mask.argmin())
            i = stop
        return max(0, end - start)

    def __contains__(self, h: object) -> bool:
        if not isinstance(h, bytes):
            return False
        if len(h) != self._width:
            return h in self._other
        known = self._view.get(h)
        return bool(self._base.find(cols_of([h], self._width))[1][0]) if known is None else known

    def __len__(self) -> int:
        return (self._base.n - len(self._frozen_removed) + len(self._frozen_added) - len(self._removed)
                + len(self._added) + len(self._other))

    def __iter__(self) -> Iterator[bytes]:
        """Every hash (a snapshot is the caller's: the set must not change meanwhile)."""
        base, hidden = self._base, self._frozen_removed | self._removed
        for a in range(0, base.n, _CHUNK):
            rows = np.stack([c[a : a + _CHUNK] for c in base.cols], axis=1).astype(">u8")
            items: list[bytes] = np.frombuffer(rows.tobytes(), f"V{self._width}").tolist()
            yield from (items if not hidden else (h for h in items if h not in hidden))
        yield from self._frozen_added - self._removed
        yield from self._added
        yield from self._other

    # -- changes ------------------------------------------------------------------------
    def _split_widths(self, hs: set[bytes]) -> set[bytes]:
        """Those of `hs` of this set's width (adopted from the first valid one while the
        columns are empty and no width is set)."""
        if self._width is None and not self._base.n:
            self._width = _common_width(hs)[0]
            if self._width is not None:  # (held until now as others: move those of the width)
                moved = {h for h in self._other if len(h) == self._width}
                self._other -= moved
                self._added |= moved
                self._view.update(dict.fromkeys(moved, True))
        return self._of_width(hs)

    def _of_width(self, hs: set[bytes]) -> set[bytes]:
        """Those of `hs` of this set's width: `hs` itself where all are (two C-level passes;
        the lengths summing to the width's multiple and none longer means all equal)."""
        w = self._width
        if w is not None and hs and len(b"".join(hs)) == w * len(hs) and max(map(len, hs)) == w:
            return hs
        return {h for h in hs if len(h) == w}

    def update(self, hashes: Iterable[bytes]) -> None:
        """Add every one of `hashes`."""
        hs = set(hashes)
        mine = self._split_widths(hs)
        if mine is not hs:
            self._other.update(hs - mine)
        mine = mine - self._added  # (not -=: that walks all of `_added`; this walks `mine`)
        back = mine & self._removed
        self._removed -= back
        mine -= back
        self._view.update(dict.fromkeys(back, True))
        if mine:
            todo = list(mine)
            new = list(compress(todo, ~self._in_base(todo)))
            self._added.update(new)
            self._view.update(dict.fromkeys(new, True))
        self._maybe_merge()
        if len(self._other) > max(self._merge_min, 2 * self._other_seen):
            self._rewiden()

    def _rewiden(self) -> None:
        """Take the columns' width from the plain set where hashes of one valid length there
        outnumber those in the columns (the width came from a stray key: held in the plain
        set, they would cost what the columns save). Counted each time the plain set doubles,
        so O(1) amortized a hash. A merge under way is superseded."""
        self._other_seen = len(self._other)
        width, count = _common_width(self._other)
        if width is None or count <= len(self) - len(self._other):
            return
        fresh = CompactHashSet.from_keys(list(self), merge_share=self._merge_share, merge_min=self._merge_min,
                                         width=width)
        kept = {"num_merges": self.num_merges + 1, "_other_seen": self._other_seen,
                "_generation": self._generation, "defer_merges": self.defer_merges}
        self.__dict__.update(fresh.__dict__)
        self.__dict__.update(kept)

    def difference_update(self, hashes: Iterable[bytes]) -> None:
        """Remove every one of `hashes` held."""
        hs = set(hashes)
        mine = self._of_width(hs)
        if mine is not hs:
            self._other.difference_update(hs - mine)
        gone = mine & self._added
        self._added -= gone
        mine -= gone
        mine = mine - self._removed  # (as in `update`)
        self._view.update(dict.fromkeys(gone, False))
        if mine:
            todo = list(mine)
            held = list(compress(todo, self._in_base(todo)))
            self._removed.update(held)
            self._view.update(dict.fromkeys(held, False))
        self._maybe_merge()

    def add(self, h: bytes) -> None:
        self.update((h,))

    def discard(self, h: bytes) -> None:
        self.difference_update((h,))

    # -- merges -------------------------------------------------------------------------
    @property
    def merge_due(self) -> bool:
        """Whether the changes have outgrown `max(merge_min, merge_share * len)` and no merge
        is under way; counted in `_view`, which also holds changes that undid themselves (so
        churn merges too)."""
        return not self._merging and len(self._view) > max(self._merge_min, self._merge_share * self._base.n)

    def _maybe_merge(self) -> None:
        if not self.defer_merges and self.merge_due:
            self.merge()

    def start_merge(self) -> MergeJob | None:
        """Freeze the delta sets for a merge (new changes go to fresh ones) and return the
        job that builds the columns from them; None if there is nothing to merge or a merge
        is under way."""
        if self._merging or self._width is None:
            return None
        if not (self._added or self._removed):
            self._view = {}  # (changes that undid themselves: nothing to merge)
            return None
        self._generation += 1
        self._merging = self._generation
        self._frozen_added, self._frozen_removed = self._added, self._removed
        self._added, self._removed = set(), set()
        return MergeJob(self._generation, self._base, self._width, self._frozen_added, self._frozen_removed)

    def finish_merge(self, job: MergeJob, merged: SortedColumns) -> bool:
        """Put the columns `job` built in place and drop the frozen sets; False (nothing
        changed) if the job was superseded (by `merge`, a rewidening or `abandon_merge`)."""
        if self._merging != job.generation:
            return False
        self._base = merged
        self._frozen_added, self._frozen_removed = set(), set()
        self._view = {**dict.fromkeys(self._removed, False), **dict.fromkeys(self._added, True)}
        self._merging = 0
        self.num_merges += 1
        return True

    def abandon_merge(self, job: MergeJob) -> None:
        """`job` failed: its frozen sets return to the delta sets."""
        if self._merging == job.generation:
            self._thaw()

    def _thaw(self) -> None:
        """Fold the frozen sets back into the delta sets (relative to the columns again)."""
        fa, fr, a, r = self._frozen_added, self._frozen_removed, self._added, self._removed
        self._added, self._removed = (fa - r) | (a - fr), (fr - a) | (r - fa)
        self._frozen_added, self._frozen_removed = set(), set()
        self._merging = 0

    def merge(self) -> None:
        """Fold every delta set into new columns now (O(len) array work); a merge under way
        is superseded."""
        if self._merging:
            self._thaw()
        if not (self._added or self._removed):
            self._view = {}  # (changes that undid themselves: nothing to merge)
            return
        assert self._width is not None
        self._base = self._base.merged(self._width, self._added, self._removed)
        self._added, self._removed, self._view = set(), set(), {}
        self.num_merges += 1

    def same_as(self, other: CompactHashSet) -> bool:
        """Whether both hold exactly the same hashes (merges both first)."""
        if len(self) != len(other):
            return False
        if self._width != other._width:  # (only where hashes of several lengths were held)
            return set(self) == set(other)
        self.merge()
        other.merge()
        return self._other == other._other and self._base.same_rows(other._base)
