"""Sorted hashes as NumPy columns: the immutable base of the disk tier's compact hash set.

`SortedColumns` holds hashes of one width (a multiple of 8 bytes) as `width / 8` uint64
columns sorted together in byte order, with a directory of where each leading-bits bucket
starts (1 to 2 bytes per hash) so that a probe reads one or two cache lines of the columns
instead of binary-searching the whole array. It is never changed once built: a merge
(`merged`) builds another, so a thread may merge one while others probe it
(`tiers/disk/hashset.py`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Column = npt.NDArray[np.uint64]
Mask = npt.NDArray[np.bool_]
_DIRECTORY_CHUNK = 1 << 13  # rows a pass over the columns takes at once (its temporaries stay small)
_BUCKET_LOAD = 2  # 2 to 4 hashes per directory bucket (1 to 2 bytes of directory per hash)


def split(rows: npt.NDArray[np.uint8]) -> list[Column]:
    """Columns (native uint64) of `rows`, an (n, width) byte array."""
    words = rows.view(">u8")
    return [words[:, i].astype(np.uint64) for i in range(words.shape[1])]


def cols_of(hashes: Sequence[bytes], width: int) -> list[Column]:
    """Columns of `hashes`, all `width` bytes long."""
    return split(np.frombuffer(b"".join(hashes), np.uint8).reshape(len(hashes), width))


class SortedColumns:
    """Sorted, unique rows and their bucket directory; immutable."""

    def __init__(self, cols: list[Column]) -> None:
        """Hold `cols` (sorted together, no row repeated) and build the directory."""
        self.cols = cols
        n = len(cols[0]) if cols else 0
        bits = max(0, (n // _BUCKET_LOAD).bit_length() - 1)
        self.shift = 64 - bits
        starts = np.full((1 << bits) + 1, n, np.int32 if n < 2**31 else np.int64)
        for a in range(0, n, _DIRECTORY_CHUNK):  # (in pieces: no transient as long as the set)
            piece = cols[0][a : a + _DIRECTORY_CHUNK]
            top = (piece >> np.uint64(self.shift)).astype(np.int64) if bits else np.zeros(len(piece), np.int64)
            first = np.flatnonzero(np.diff(top, prepend=-1))  # where each bucket's run starts in the piece
            starts[top[first]] = np.minimum(starts[top[first]], a + first)  # (a run may begin in an earlier piece)
        self.starts: npt.NDArray[np.signedinteger[Any]] = np.minimum.accumulate(starts[::-1])[::-1].copy()
        sizes = np.diff(self.starts)  # (an empty bucket starts where the next does)
        self.steps = int(sizes.max()).bit_length() if n else 0  # halvings that cover the largest bucket

    @property
    def n(self) -> int:
        return len(self.cols[0]) if self.cols else 0

    def _lower(self, q0: Column) -> npt.NDArray[np.int64]:
        """For each value, the first position whose leading column is not below it: from the
        start of its bucket, a branch-free binary search of `steps` halvings (every value
        past the bucket is above it, so a window wider than the bucket is as good)."""
        c0, last = self.cols[0], len(self.cols[0]) - 1
        top = (q0 >> np.uint64(self.shift)).astype(np.int64) if self.shift < 64 else np.zeros(len(q0), np.int64)
        pos: npt.NDArray[np.int64] = self.starts[top].astype(np.int64)
        probe = np.empty_like(pos)
        for k in range(self.steps - 1, -1, -1):
            np.add(pos, (1 << k) - 1, out=probe)
            np.minimum(probe, last, out=probe)
            pos += (c0[probe] < q0) << k
        return np.minimum(pos, last + 1, out=pos)

    def find(self, q: list[Column]) -> tuple[npt.NDArray[np.int64], Mask]:
        """(where each row of `q` is or would go in byte order, whether it is there)."""
        n = self.n
        if not n:
            return np.zeros(len(q[0]), np.int64), np.zeros(len(q[0]), np.bool_)
        pos = self._lower(q[0])
        at = np.minimum(pos, n - 1)
        lead = (pos < n) & (self.cols[0][at] == q[0])
        found = lead.copy()
        for c, qc in zip(self.cols[1:], q[1:], strict=True):
            found &= c[at] == qc
        for i in np.flatnonzero(lead & ~found):  # leading words equal, not the rest: rare
            pos[i], found[i] = self._narrow(int(pos[i]), [qc[i] for qc in q])
        return pos, found

    def _narrow(self, lo: int, row: list[np.uint64]) -> tuple[int, bool]:
        """(where `row`, whose leading word is first at `lo`, is or would go, whether it is
        there): a binary search column by column over the rows sharing its leading words,
        O(log n) however many share them (a walk was O(their number) per probe)."""
        hi = lo + int(np.searchsorted(self.cols[0][lo:], row[0], "right"))
        for c, v in zip(self.cols[1:], row[1:], strict=True):
            within = c[lo:hi]  # (sorted: the words before are equal here)
            lo, hi = lo + int(np.searchsorted(within, v, "left")), lo + int(np.searchsorted(within, v, "right"))
            if lo == hi:
                return lo, False
        return lo, True

    def merged(self, width: int, added: Collection[bytes], removed: Collection[bytes]) -> SortedColumns:
        """Another `SortedColumns`: these rows less `removed` (all held here) plus `added`
        (none held here), all `width` bytes long. O(n) array work; changes nothing here."""
        cols = self.cols or [np.zeros(0, np.uint64) for _ in range(width // 8)]
        gone = np.sort(self.find(cols_of(list(removed), width))[0]) if removed else None
        new: list[Column] = []
        at: npt.NDArray[np.int64] | None = None
        if added:
            new = sorted_unique(cols_of(list(added), width))
            at = self.find(new)[0]
            if gone is not None:
                at = at - np.searchsorted(gone, at)  # positions once the removed are gone
        if gone is not None:
            cols = [np.delete(c, gone) for c in cols]
        if at is not None:
            cols = [np.insert(c, at, v) for c, v in zip(cols, new, strict=True)]
        return SortedColumns(cols)

    def same_rows(self, other: SortedColumns) -> bool:
        return self.n == other.n and (not self.n or all(
            np.array_equal(a, b) for a, b in zip(self.cols, other.cols, strict=True)))


def in_order(cols: list[Column]) -> bool:
    """Whether the rows are strictly increasing in byte order (checked in pieces)."""
    n = len(cols[0])
    return all(compare([c[a : a + _DIRECTORY_CHUNK + 1] for c in cols])[0].all()
               for a in range(0, n - 1, _DIRECTORY_CHUNK))


def sorted_unique(cols: list[Column]) -> list[Column]:
    """Columns sorted together in byte order, repeated rows dropped."""
    if len(cols[0]) < 2 or in_order(cols):
        return cols
    order = np.lexsort(cols[::-1])
    cols = [c[order] for c in cols]
    same = compare(cols)[1]
    if same.any():
        keep = np.concatenate(([True], ~same))
        cols = [c[keep] for c in cols]
    return cols


def compare(cols: list[Column]) -> tuple[Mask, Mask]:
    """(each row is after the one before it, each row equals the one before it)."""
    ahead = np.zeros(len(cols[0]) - 1, np.bool_)
    same = np.ones(len(cols[0]) - 1, np.bool_)
    for c in cols:
        ahead |= same & (c[1:] > c[:-1])
        same &= c[1:] == c[:-1]
    return ahead, same
