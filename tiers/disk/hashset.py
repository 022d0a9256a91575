"""A compact set of block hashes: sorted NumPy columns, small delta sets, vectorized probes.

The disk tier keeps one in every process (`tiers/disk/mirror.py`). Hashes of the set's width
(the most common length among the first it holds: 16 bytes for xxh3-128, 32 for sha256; a
multiple of 8; a stray damaged key does not decide it, and gives way where it did) are
held as `width / 8` big-endian uint64 columns sorted together (so in byte order, the order
LMDB's cursor yields them: a build from the index sorts nothing), 16 bytes per block at
width 16, plus a directory of where each leading-bits bucket starts (1 to 2 bytes per block)
so that a probe reads one or two cache lines of the columns instead of binary-searching the
whole array. Stores and removals go to two small Python sets (`_added`: not in the columns,
`_removed`: in them), merged into the columns once they exceed `merge_share` of them, so a
change costs O(1) amortized. Hashes of any other length sit in a plain set (`_other`).

Probes take a whole prompt's hashes at once (`held`, `count_prefix`): one `b"".join`, one
`np.frombuffer` and a few array operations, however many blocks. Not thread-safe: the
caller holds a lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, islice
from typing import Any

import numpy as np
import numpy.typing as npt

Column = npt.NDArray[np.uint64]
Mask = npt.NDArray[np.bool_]
_CHUNK = 1 << 10  # keys joined at once by a build (its buffers stay below malloc's mmap threshold)
_DIRECTORY_CHUNK = 1 << 13  # rows a pass over the columns takes at once (its temporaries stay small)
_BUCKET_LOAD = 2  # 2 to 4 hashes per directory bucket (1 to 2 bytes of directory per hash)
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


class CompactHashSet:
    """A set of `bytes` (block hashes); `merge_share` and `merge_min` decide when the delta
    sets are merged into the sorted columns (past `max(merge_min, merge_share * len)`)."""

    def __init__(self, *, merge_share: float = 1 / 32, merge_min: int = 4096) -> None:
        self._width: int | None = None
        self._cols: list[Column] = []
        self._starts: npt.NDArray[np.signedinteger[Any]] = np.zeros(2, np.int64)
        self._shift = 64
        self._steps = 0
        self._added: set[bytes] = set()
        self._removed: set[bytes] = set()
        self._other: set[bytes] = set()
        self._merge_share, self._merge_min = merge_share, merge_min
        self._other_seen = 0  # the plain set's size when its widths were last counted
        self.num_merges = 0

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
            self._set_cols(cols if _in_order(cols) else _sorted_unique(cols))
        return self

    def _split(self, rows: npt.NDArray[np.uint8]) -> list[Column]:
        """Columns (native uint64) of `rows`, an (n, width) byte array."""
        words = rows.view(">u8")
        return [words[:, i].astype(np.uint64) for i in range(words.shape[1])]

    def _cols_of(self, hashes: Sequence[bytes]) -> list[Column]:
        """Columns of hashes all of this set's width."""
        assert self._width is not None
        return self._split(np.frombuffer(b"".join(hashes), np.uint8).reshape(len(hashes), self._width))

    def _set_cols(self, cols: list[Column]) -> None:
        """Hold `cols` (sorted, unique) and rebuild the bucket directory."""
        self._cols = cols
        n = len(cols[0]) if cols else 0
        bits = max(0, (n // _BUCKET_LOAD).bit_length() - 1)
        self._shift = 64 - bits
        starts = np.full((1 << bits) + 1, n, np.int32 if n < 2**31 else np.int64)
        for a in range(0, n, _DIRECTORY_CHUNK):  # (in pieces: no transient as long as the set)
            piece = cols[0][a : a + _DIRECTORY_CHUNK]
            top = (piece >> np.uint64(self._shift)).astype(np.int64) if bits else np.zeros(len(piece), np.int64)
            first = np.flatnonzero(np.diff(top, prepend=-1))  # where each bucket's run starts in the piece
            starts[top[first]] = np.minimum(starts[top[first]], a + first)  # (a run may begin in an earlier piece)
        self._starts = np.minimum.accumulate(starts[::-1])[::-1].copy()  # an empty bucket starts where the next does
        sizes = np.diff(self._starts)
        self._steps = int(sizes.max()).bit_length() if n else 0  # halvings that cover the largest bucket

    @property
    def width(self) -> int | None:
        """The length of the hashes held in the columns (None until one is held)."""
        return self._width

    # -- probes -------------------------------------------------------------------------
    def _n(self) -> int:
        return len(self._cols[0]) if self._cols else 0

    def _lower(self, q0: Column) -> npt.NDArray[np.int64]:
        """For each value, the first position whose leading column is not below it: from the
        start of its bucket, a branch-free binary search of `_steps` halvings (every value
        past the bucket is above it, so a window wider than the bucket is as good)."""
        c0, last = self._cols[0], len(self._cols[0]) - 1
        top = (q0 >> np.uint64(self._shift)).astype(np.int64) if self._shift < 64 else np.zeros(len(q0), np.int64)
        pos: npt.NDArray[np.int64] = self._starts[top].astype(np.int64)
        probe = np.empty_like(pos)
        for k in range(self._steps - 1, -1, -1):
            np.add(pos, (1 << k) - 1, out=probe)
            np.minimum(probe, last, out=probe)
            pos += (c0[probe] < q0) << k
        return np.minimum(pos, last + 1, out=pos)

    def _find(self, q: list[Column]) -> tuple[npt.NDArray[np.int64], Mask]:
        """(where each row of `q` is or would go in byte order, whether it is there)."""
        n = self._n()
        if not n:
            return np.zeros(len(q[0]), np.int64), np.zeros(len(q[0]), np.bool_)
        pos = self._lower(q[0])
        at = np.minimum(pos, n - 1)
        lead = (pos < n) & (self._cols[0][at] == q[0])
        found = lead.copy()
        for c, qc in zip(self._cols[1:], q[1:], strict=True):
            found &= c[at] == qc
        for i in np.flatnonzero(lead & ~found):  # leading words equal, not the rest: rare
            pos[i], found[i] = self._narrow(int(pos[i]), [qc[i] for qc in q])
        return pos, found

    def _narrow(self, lo: int, row: list[np.uint64]) -> tuple[int, bool]:
        """(where `row`, whose leading word is first at `lo`, is or would go, whether it is
        there): a binary search column by column over the rows sharing its leading words,
        O(log n) however many share them (a walk was O(their number) per probe)."""
        hi = lo + int(np.searchsorted(self._cols[0][lo:], row[0], "right"))
        for c, v in zip(self._cols[1:], row[1:], strict=True):
            within = c[lo:hi]  # (sorted: the words before are equal here)
            lo, hi = lo + int(np.searchsorted(within, v, "left")), lo + int(np.searchsorted(within, v, "right"))
            if lo == hi:
                return lo, False
        return lo, True

    def held(self, hashes: Sequence[bytes]) -> Mask:
        """Whether each of `hashes` is in the set, vectorized."""
        n = len(hashes)
        if not n:
            return np.zeros(0, np.bool_)
        joined = b"".join(hashes)
        if len(joined) != n * (self._width or 0) or max(map(len, hashes)) != self._width:  # (mixed: rare)
            return np.fromiter(map(self.__contains__, hashes), np.bool_, n)
        found = self._find(self._split(np.frombuffer(joined, np.uint8).reshape(n, len(joined) // n)))[1]
        if self._removed:
            found &= ~np.fromiter(map(self._removed.__contains__, hashes), np.bool_, n)
        if self._added:
            found |= np.fromiter(map(self._added.__contains__, hashes), np.bool_, n)
        return found

    def count_prefix(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """How many consecutive `hashes[start:]` are in the set: the first 16 probed, then the
        rest at once, so a prompt missing early costs one small probe."""
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
        if h in self._added:
            return True
        return h not in self._removed and bool(self._find(self._cols_of([h]))[1][0])

    def __len__(self) -> int:
        return self._n() - len(self._removed) + len(self._added) + len(self._other)

    def __iter__(self) -> Iterator[bytes]:
        """Every hash (a snapshot is the caller's: the set must not change meanwhile)."""
        n, removed = self._n(), self._removed
        for a in range(0, n, _CHUNK):
            rows = np.stack([c[a : a + _CHUNK] for c in self._cols], axis=1).astype(">u8")
            items: list[bytes] = np.frombuffer(rows.tobytes(), f"V{self._width}").tolist()
            yield from (items if not removed else (h for h in items if h not in removed))
        yield from self._added
        yield from self._other

    # -- changes ------------------------------------------------------------------------
    def _split_widths(self, hashes: Iterable[bytes]) -> set[bytes]:
        """Those of `hashes` of this set's width (adopted from the first valid one while the
        columns are empty and no width is set)."""
        hs = set(hashes)
        if self._width is None and not self._n():
            self._width = _common_width(hs)[0]
            if self._width is not None:  # (held until now as others: move those of the width)
                moved = {h for h in self._other if len(h) == self._width}
                self._other -= moved
                self._added |= moved
        return {h for h in hs if len(h) == self._width}

    def update(self, hashes: Iterable[bytes]) -> None:
        """Add every one of `hashes`."""
        hs = set(hashes)
        mine = self._split_widths(hs)
        self._other.update(hs - mine)
        mine -= self._added
        back = mine & self._removed
        self._removed -= back
        mine -= back
        if mine:
            todo = list(mine)
            self._added.update(compress(todo, ~self._find(self._cols_of(todo))[1]))
        self._maybe_merge()
        if len(self._other) > max(self._merge_min, 2 * self._other_seen):
            self._rewiden()

    def _rewiden(self) -> None:
        """Take the columns' width from the plain set where hashes of one valid length there
        outnumber those in the columns (the width came from a stray key: held in the plain
        set, they would cost what the columns save). Counted each time the plain set doubles,
        so O(1) amortized a hash."""
        self._other_seen = len(self._other)
        width, count = _common_width(self._other)
        if width is None or count <= len(self) - len(self._other):
            return
        fresh = CompactHashSet.from_keys(list(self), merge_share=self._merge_share, merge_min=self._merge_min,
                                         width=width)
        merges, seen = self.num_merges + 1, self._other_seen
        self.__dict__.update(fresh.__dict__)
        self.num_merges, self._other_seen = merges, seen

    def difference_update(self, hashes: Iterable[bytes]) -> None:
        """Remove every one of `hashes` held."""
        hs = set(hashes)
        mine = {h for h in hs if len(h) == self._width}
        self._other.difference_update(hs - mine)
        gone = mine & self._added
        self._added -= gone
        mine -= gone
        mine -= self._removed
        if mine:
            todo = list(mine)
            self._removed.update(compress(todo, self._find(self._cols_of(todo))[1]))
        self._maybe_merge()

    def add(self, h: bytes) -> None:
        self.update((h,))

    def discard(self, h: bytes) -> None:
        self.difference_update((h,))

    def _maybe_merge(self) -> None:
        if len(self._added) + len(self._removed) > max(self._merge_min, self._merge_share * self._n()):
            self.merge()

    def merge(self) -> None:
        """Fold the delta sets into the sorted columns (O(len) array work)."""
        if not (self._added or self._removed):
            return
        assert self._width is not None
        cols = self._cols or [np.zeros(0, np.uint64) for _ in range(self._width // 8)]
        gone = np.sort(self._find(self._cols_of(list(self._removed)))[0]) if self._removed else None
        new: list[Column] = []
        at: npt.NDArray[np.int64] | None = None
        if self._added:
            new = _sorted_unique(self._cols_of(list(self._added)))
            at = self._find(new)[0]
            if gone is not None:
                at = at - np.searchsorted(gone, at)  # positions once the removed are gone
        if gone is not None:
            cols = [np.delete(c, gone) for c in cols]
        if at is not None:
            cols = [np.insert(c, at, v) for c, v in zip(cols, new, strict=True)]
        self._added, self._removed = set(), set()
        self._set_cols(cols)
        self.num_merges += 1

    def same_as(self, other: CompactHashSet) -> bool:
        """Whether both hold exactly the same hashes (merges both first)."""
        if len(self) != len(other):
            return False
        if self._width != other._width:  # (only where hashes of several lengths were held)
            return set(self) == set(other)
        self.merge()
        other.merge()
        return self._other == other._other and self._n() == other._n() and (not self._n() or all(
            np.array_equal(a, b) for a, b in zip(self._cols, other._cols, strict=True)))


def _in_order(cols: list[Column]) -> bool:
    """Whether the rows are strictly increasing in byte order (checked in pieces)."""
    n = len(cols[0])
    return all(_compare([c[a : a + _DIRECTORY_CHUNK + 1] for c in cols])[0].all()
               for a in range(0, n - 1, _DIRECTORY_CHUNK))


def _sorted_unique(cols: list[Column]) -> list[Column]:
    """Columns sorted together in byte order, repeated rows dropped."""
    if len(cols[0]) < 2 or _in_order(cols):
        return cols
    order = np.lexsort(cols[::-1])
    cols = [c[order] for c in cols]
    same = _compare(cols)[1]
    if same.any():
        keep = np.concatenate(([True], ~same))
        cols = [c[keep] for c in cols]
    return cols


def _compare(cols: list[Column]) -> tuple[Mask, Mask]:
    """(each row is after the one before it, each row equals the one before it)."""
    ahead = np.zeros(len(cols[0]) - 1, np.bool_)
    same = np.ones(len(cols[0]) - 1, np.bool_)
    for c in cols:
        ahead |= same & (c[1:] > c[:-1])
        same &= c[1:] == c[:-1]
    return ahead, same
