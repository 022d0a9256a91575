"""Asking the kernel to read mapped pages ahead (`madvise(MADV_WILLNEED)`).

A disk tier's records are views into LMDB's memory map; reading them one after another
faults their pages in one at a time (queue depth 1). Advising every record of a run first
starts the reads for all of them at once, so the device works with many requests in flight
while the records are validated and copied in order. Best effort: where `madvise` is not
available the advice is skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable

import numpy as np

_PAGE = mmap.PAGESIZE
_MADV_WILLNEED = 3  # Linux, macOS and the BSDs agree on this value
_madvise = None
if sys.platform.startswith("linux") or sys.platform == "darwin":
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def will_need(views: Iterable[memoryview]) -> int:
    """Advise the kernel that the pages under each view will be read soon; return how many
    views were advised (0 where unsupported). Never raises."""
    if _madvise is None:
        return 0
    advised = 0
    for view in views:
        if not len(view):
            continue
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        start = addr & ~(_PAGE - 1)
        if _madvise(start, addr + len(view) - start, _MADV_WILLNEED) == 0:
            advised += 1
    return advised
