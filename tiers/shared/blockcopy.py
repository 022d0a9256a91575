"""Host memory helpers: `copy_block` (one block's copy, single-threaded when both sides are in
host memory) and `mapped_tensor` (a tensor over a mapping of its own).

torch's CPU `copy_` splits even a small block over its OpenMP pool; on a busy machine (or
inside an engine that pinned the pool to its own cores) the threads' hand-offs can cost a
thousand times the copy itself. A block is small enough that one thread's memcpy is best.
"""

from __future__ import annotations

import math
import mmap
import os

import numpy as np
import torch


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy byte view of a host-memory tensor whose innermost dimension is contiguous;
    None for any other tensor (device memory, a 0-d tensor, strides a byte view cannot express)."""
    if t.device.type != "cpu" or t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for same-shape, same-dtype blocks, on one thread where both are on CPU."""
    if dst.dtype == src.dtype and dst.shape == src.shape:
        d, s = host_bytes(dst), host_bytes(src)
        if d is not None and s is not None:
            np.copyto(d, s)
            return
    dst.copy_(src)


def mapped_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor over an anonymous memory mapping of its own.

    Unlike `torch.empty`, whose large allocations malloc may carve out of a heap that earlier
    frees left behind, the memory goes back to the OS as soon as the last tensor or view over it
    is dropped (the mapping is unmapped), whatever else the process allocated before.
    """
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
