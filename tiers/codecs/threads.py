"""Run torch's CPU ops on the calling thread only, for the length of a `with` block.

A codec's ops each span a whole half-block (half a million elements for 2 MiB), past the
size where torch hands an op to its intra-op thread pool. That pool is the engine's: waking
it for every pass of a codec costs milliseconds per op on a busy host and takes cores the
engine computes on. `one_thread()` sets OpenMP's thread count of the calling thread alone
(`omp_set_num_threads` changes only the calling thread's setting, and ATen asks OpenMP for
it on each op), then puts it back: other threads, and torch's process-wide setting
(`torch.set_num_threads`), are untouched. Where torch is not built on OpenMP, or its
OpenMP library is not found among the loaded ones, it does nothing.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_lock = threading.Lock()
_omp: ctypes.CDLL | None = None
_looked = False


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (found in this process's mappings); None if none is."""
    global _omp, _looked
    with _lock:
        if not _looked:
            _looked = True
            try:
                if "OpenMP" not in torch.__config__.parallel_info():
                    return None
                maps = Path("/proc/self/maps").read_text()
                libs = sorted({line.split()[-1] for line in maps.splitlines()
                               if line.rstrip().endswith((".so", ".so.1")) and ("gomp" in line or "iomp" in line)},
                              key=lambda path: ("/torch/" not in path, path))  # torch's own runtime first
                if libs:
                    lib = ctypes.CDLL(libs[0])
                    lib.omp_get_max_threads.restype = ctypes.c_int
                    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                    _omp = lib
            except (OSError, AttributeError):
                _omp = None
        return _omp


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch CPU ops inside run on the calling thread (see the module)."""
    omp = _openmp()
    if omp is not None:
        torch.get_num_threads()  # ATen sets a new thread's OpenMP count on its first use: not inside
    if omp is None:
        yield
        return
    before = omp.omp_get_max_threads()
    if before == 1:
        yield
        return
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(before)
