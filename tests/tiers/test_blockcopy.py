"""`copy_block` equals `Tensor.copy_` for every KV dtype and stride pattern it meets."""

from __future__ import annotations

import pytest
import torch

import kvstore  # noqa: F401  (before tiers: `import tiers` alone is circular today)
from tiers.blockcopy import copy_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_copy_block_matches_copy_(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 255, (2, 2, 4, 3, 8), generator=g, dtype=torch.uint8)
    if dtype.itemsize != 1:
        shape = (2, 2, 4, 3, 8 * dtype.itemsize)
        src = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    src = src.view(dtype)
    dst = torch.zeros_like(src)
    copy_block(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_copy_block_strided_views() -> None:
    big = torch.arange(4 * 2 * 4 * 3 * 8, dtype=torch.float32).view(4, 2, 4, 3, 8)
    src = big[:, :, 1:3]  # strided
    dst_big = torch.zeros(4, 2, 5, 3, 8)
    dst = dst_big[:, :, 2:4]
    copy_block(dst, src)
    assert torch.equal(dst, src) and not dst_big[:, :, :2].any()
    t = torch.zeros(3, 8).t()  # last dim strided: falls back to torch
    copy_block(t, torch.ones(8, 3))
    assert torch.equal(t, torch.ones(8, 3))
