"""Recycled `retrieve()` results (`kvstore/buffers.py`): small and long results reuse memory."""

from __future__ import annotations

import gc

import torch

from kvstore.buffers import BufferPool


def test_results_within_the_cap_are_recycled() -> None:
    pool = BufferPool(64 << 20)
    t = pool.tensor((4 << 20,), torch.uint8)
    ptr = t.data_ptr()
    del t
    gc.collect()
    again = pool.tensor((4 << 20,), torch.uint8)
    assert again.data_ptr() == ptr and pool.num_reused == 1 and pool.num_allocated == 1


def test_a_result_larger_than_the_cap_is_recycled_too() -> None:
    """A long prompt's result (here 24 MiB against an 8 MiB cap) is kept as the one oversize
    buffer, and serves the next request of about its size (not much smaller ones)."""
    pool = BufferPool(8 << 20)
    t = pool.tensor((24 << 20,), torch.uint8)
    ptr = t.data_ptr()
    del t
    gc.collect()
    again = pool.tensor((23 << 20,), torch.uint8)  # within a third: reused
    assert again.data_ptr() == ptr and pool.num_reused == 1
    del again
    gc.collect()
    small = pool.tensor((6 << 20,), torch.uint8)  # would waste most of it: a fresh buffer
    assert small.data_ptr() != ptr and pool.num_allocated == 2
    held = pool.tensor((24 << 20,), torch.uint8)  # the oversize buffer is still there
    assert held.data_ptr() == ptr


def test_zero_cap_recycles_nothing() -> None:
    pool = BufferPool(0)
    t = pool.tensor((8 << 20,), torch.uint8)
    del t
    gc.collect()
    pool.tensor((8 << 20,), torch.uint8)
    assert pool.num_reused == 0
