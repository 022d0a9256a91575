"""Host buffers for `retrieve` results that are recycled instead of faulted in anew.

A fresh allocation of a few MiB costs more than the copy into it: every 4 KiB page faults and
is zeroed on first touch. `BufferPool.tensor` hands out tensors over pre-faulted buffers
(advised to use huge pages), and takes each buffer back when the last tensor or view over it
is garbage collected, so steady traffic reuses warm memory. The caller owns what it gets
until it drops it; at most `max_free_bytes` of idle buffers are kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import weakref

import numpy as np
import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(ctypes.util.find_library("c") or None).madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def _size_class(num_bytes: int) -> int:
    """Buffers come in multiples of 2 MiB (1/8 steps above 16 MiB), so sizes repeat."""
    size = max(_HUGE, -(-num_bytes // _HUGE) * _HUGE)
    if size > 16 * _HUGE:
        step = 1 << (size.bit_length() - 4)
        size = -(-size // step) * step
    return size


class BufferPool:
    """Recycled host buffers; thread-safe."""

    def __init__(self, max_free_bytes: int) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.num_reused = self.num_allocated = 0

    def _new(self, size: int) -> np.ndarray:
        buf = np.empty(size + _HUGE, dtype=np.uint8)  # room to start on a huge-page boundary
        start = -buf.ctypes.data % _HUGE
        buf = buf[start : start + size]
        if _madvise is not None:
            _madvise(buf.ctypes.data, size, _MADV_HUGEPAGE)
        buf.fill(0)  # fault it in now, once
        self.num_allocated += 1
        return buf

    def _give_back(self, size: int, buf: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + size <= self.max_free_bytes:
                self._free.setdefault(size, []).append(buf)
                self._free_bytes += size

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` on warm host memory (contents undefined)."""
        num_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if num_bytes < _HUGE or self.max_free_bytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = _size_class(num_bytes)
        with self._lock:
            pool = self._free.get(size)
            buf = pool.pop() if pool else None
            if buf is not None:
                self._free_bytes -= size
                self.num_reused += 1
        if buf is None:
            buf = self._new(size)
        owner = buf[:num_bytes]  # the tensor keeps this view alive; when it dies, `buf` returns
        weakref.finalize(owner, self._give_back, size, buf)
        return torch.from_numpy(owner).view(dtype).view(shape)
