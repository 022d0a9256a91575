"""Blocks that are rows of one tensor, and copies between such rows in as few operations as
possible.

A sequence's KV `[L, 2, n * b, H, D]` is, viewed as `[n, L, 2, b, H, D]`, n block *rows* of
one strided tensor; so is a tier's slab or a pool's KV cache. `BlockBatch` is a sequence of
block views that remembers those rows, so a tier can copy many blocks with one operation per
run of consecutive rows instead of one Python-level copy per block (`copy_rows`). Anything
that takes a sequence of block tensors accepts a `BlockBatch` and sees plain views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import torch

from tiers.shared.blockcopy import host_bytes


def block_rows(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[n, L, 2, b, H, D]` strided view of the full blocks of `kv` `[L, 2, T, H, D]` (no copy)."""
    n = kv.shape[2] // block_size
    s0, s1, s2, s3, s4 = kv.stride()
    layers, two, _, heads, dim = kv.shape
    return kv.as_strided((n, layers, two, block_size, heads, dim), (block_size * s2, s0, s1, s2, s3, s4),
                         kv.storage_offset())


class BlockBatch(Sequence[torch.Tensor]):
    """Block views `rows[row_ids[i]]` of one tensor `rows` `[N, *block_shape]`.

    Slicing (any step) and `select` keep the rows, so a copy plan can still see them.
    """

    __slots__ = ("row_ids", "rows")

    def __init__(self, rows: torch.Tensor, index: range | Sequence[int] | None = None) -> None:
        self.rows = rows
        self.row_ids: range | Sequence[int] = range(rows.shape[0]) if index is None else index

    def __len__(self) -> int:
        return len(self.row_ids)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> BlockBatch: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | BlockBatch:
        if isinstance(i, slice):
            return BlockBatch(self.rows, self.row_ids[i])
        return self.rows[self.row_ids[i]]

    def select(self, positions: Sequence[int]) -> BlockBatch:
        """The blocks at `positions` of this batch, in that order."""
        return BlockBatch(self.rows, [self.row_ids[p] for p in positions])


def take(blocks: Sequence[torch.Tensor], positions: Sequence[int]) -> Sequence[torch.Tensor]:
    """`[blocks[p] for p in positions]`, keeping a `BlockBatch` a batch."""
    if isinstance(blocks, BlockBatch):
        return blocks.select(positions)
    return [blocks[p] for p in positions]


def _runs(dst_index: Sequence[int], src_index: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of maximal runs where both indices step by +1, after
    ordering the pairs by source row (vectorized: no per-block Python work)."""
    src = np.asarray(src_index, dtype=np.int64)
    dst = np.asarray(dst_index, dtype=np.int64)
    if len(src) > 1 and not (np.diff(src) > 0).all():
        order = np.argsort(src, kind="stable")
        src, dst = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return list(zip(dst[starts].tolist(), src[starts].tolist(), lengths.tolist()))


def copy_rows(dst: torch.Tensor, dst_index: Sequence[int], src: torch.Tensor, src_index: Sequence[int]) -> bool:
    """Copy `src[src_index[i]]` into `dst[dst_index[i]]` for every i, one copy per run of
    consecutive rows on both sides. Host memory only (single-threaded NumPy copies, which
    release the GIL); returns False, copying nothing, if either side is elsewhere."""
    if not dst_index:
        return True
    d, s = host_bytes(dst), host_bytes(src)
    if d is None or s is None or dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        return False
    for d0, s0, n in _runs(dst_index, src_index):
        np.copyto(d[d0 : d0 + n], s[s0 : s0 + n])
    return True
