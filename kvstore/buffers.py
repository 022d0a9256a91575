"""Host buffers for `retrieve` results that are recycled instead of faulted in anew.

A fresh allocation of a few MiB costs more than the copy into it: every 4 KiB page faults and
is zeroed on first touch. `BufferPool.tensor` hands out tensors over pre-faulted buffers
(advised to use huge pages), and takes each buffer back when the last tensor or view over it
is garbage collected, so steady traffic reuses warm memory. The caller owns what it gets
until it drops it. Idle buffers are kept up to `max_free_bytes`, plus one *oversize* buffer:
the most recently dropped one that did not fit under that cap (at most 1/8 of the machine's
memory), so the results of long prompts (a 16K-token context of an 8B model is 2 GiB) are
recycled too; it serves any later request it holds without wasting more than a third.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import weakref

import numpy as np
import torch

from tiers.shared.blockcopy import host_memory_bytes

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
        self._oversize: tuple[int, np.ndarray] | None = None  # (size, buffer) beyond the cap
        self._max_oversize = host_memory_bytes() // 8 if max_free_bytes else 0
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
            elif size <= self._max_oversize:
                self._oversize = (size, buf)  # replaces (frees) the previous one

    def _take(self, size: int) -> np.ndarray | None:
        """An idle buffer of class `size`, or the oversize one if it holds `size` without
        wasting more than a third of itself. Call with the lock held."""
        pool = self._free.get(size)
        if pool:
            self._free_bytes -= size
            return pool.pop()
        if self._oversize is not None and size <= self._oversize[0] <= size + size // 2:
            buf = self._oversize[1]
            self._oversize = None
            return buf
        return None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` on warm host memory (contents undefined)."""
        num_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if num_bytes < _HUGE or self.max_free_bytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = _size_class(num_bytes)
        with self._lock:
            buf = self._take(size)
            if buf is not None:
                self.num_reused += 1
        if buf is None:
            buf = self._new(size)
        size = buf.nbytes  # an oversize buffer returns to its own class
        owner = buf[:num_bytes]  # the tensor keeps this view alive; when it dies, `buf` returns
        weakref.finalize(owner, self._give_back, size, buf)
        return torch.from_numpy(owner).view(dtype).view(shape)
