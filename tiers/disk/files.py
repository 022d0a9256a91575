"""The disk tier's data files: fixed-size slots, written and read straight from tensor memory.

Payloads of one size class live in one sparse file of the directory, `slots-<bytes>.kvd`,
slot `i` at offset `i * slot_bytes`. A block's slot holds its bytes in the block's contiguous
(row-major) order. Writes gather a run of blocks into one `pwritev` from the tensors'
own memory (strided views become one iovec per contiguous piece) and reads scatter one
`preadv` into the destinations: no intermediate buffer, one kernel copy each way. A full
file system or a file-size limit surfaces as `OSError` (ENOSPC, EDQUOT, EFBIG), never as a
signal: nothing here maps a data file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiers.shared.blockcopy import host_bytes

_PAGE = 4096
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_fallocate = None
if sys.platform.startswith("linux"):
    try:
        _fallocate = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).fallocate
        _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
        _fallocate.restype = ctypes.c_int
    except (OSError, AttributeError):
        _fallocate = None

Pieces = list[Any]  # C-contiguous byte buffers (NumPy uint8 arrays, memoryviews), in the block's byte order


def slot_bytes_for(payload_bytes: int) -> int:
    """The slot size of a payload: whole 4 KiB pages, or the next power of two below a page."""
    if payload_bytes >= _PAGE:
        return -(-payload_bytes // _PAGE) * _PAGE
    return 1 << max(4, (payload_bytes - 1).bit_length())


def file_name(slot_bytes: int) -> str:
    return f"slots-{slot_bytes}.kvd"


def tensor_pieces(t: torch.Tensor) -> Pieces | None:
    """The bytes of host tensor `t` in row-major order as contiguous pieces (views, no copy),
    or None where a byte view is impossible (device memory, exotic strides)."""
    a = host_bytes(t.detach())
    return None if a is None else array_pieces(a)


def array_pieces(a: np.ndarray) -> Pieces | None:
    """`tensor_pieces` of a NumPy byte array."""
    if a.flags.c_contiguous:
        return [a.reshape(-1)]
    inner, expected = a.ndim, 1
    while inner > 0 and (a.shape[inner - 1] == 1 or a.strides[inner - 1] == expected):
        expected *= a.shape[inner - 1]
        inner -= 1
    if inner == a.ndim:  # not even the innermost dimension is dense
        return None
    flat = a.view()
    try:
        flat.shape = (-1, expected)  # collapses the outer dimensions where strides allow it
    except AttributeError:  # they do not: one piece per index of the outer dimensions
        return [a[idx].reshape(-1) for idx in np.ndindex(*a.shape[:inner])]
    return list(flat)


def _advance(pieces: Pieces, done: int) -> Pieces:
    """`pieces` without their first `done` bytes."""
    out: Pieces = []
    for p in pieces:
        if done >= p.nbytes:
            done -= p.nbytes
            continue
        out.append(p[done:] if done else p)
        done = 0
    return out


def _vectored(call: Callable[[int, Pieces, int], int], fd: int, pieces: Pieces, offset: int) -> int:
    """Run `call` (`os.pwritev` or `os.preadv`) over every piece from `offset` onwards,
    `IOV_MAX` pieces per call, resuming short transfers, until done or a call moves nothing.
    Returns the bytes moved."""
    total = 0
    todo = list(pieces)
    while todo:
        batch = todo[:_IOV_MAX]
        want = sum(p.nbytes for p in batch)
        done = call(fd, batch, offset)
        total += done
        offset += done
        if done == want:
            todo = todo[_IOV_MAX:]
        elif done == 0:
            return total
        else:
            todo = _advance(batch, done) + todo[_IOV_MAX:]
    return total


def write_all(fd: int, pieces: Pieces, offset: int) -> None:
    """Write every piece at `offset` onwards, `IOV_MAX` pieces per call, resuming short
    writes. Raises `OSError` (ENOSPC, EDQUOT, EFBIG, EIO) if the file system refuses."""
    if _vectored(os.pwritev, fd, pieces, offset) < sum(p.nbytes for p in pieces):
        raise OSError(28, "No space left on device (a write made no progress)")


def read_all(fd: int, pieces: Pieces, offset: int) -> int:
    """Fill the pieces from `offset` onwards; return the bytes read (fewer at end of file)."""
    return _vectored(os.preadv, fd, pieces, offset)


class SlotFiles:
    """This process's open data files of one directory, one per slot size; thread-safe.

    Files are created on first use and never deleted (`truncate_all` empties them).
    """

    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def fd(self, slot_bytes: int) -> int:
        with self._lock:
            fd = self._fds.get(slot_bytes)
            if fd is None:
                path = os.path.join(self._dir, file_name(slot_bytes))
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                self._fds[slot_bytes] = fd
            return fd

    def write(self, slot_bytes: int, slot: int, pieces: Pieces) -> None:
        write_all(self.fd(slot_bytes), pieces, slot * slot_bytes)

    def read(self, slot_bytes: int, slot: int, pieces: Pieces) -> int:
        return read_all(self.fd(slot_bytes), pieces, slot * slot_bytes)

    def sync(self, classes: Sequence[int]) -> None:
        """`fdatasync` the files of the given slot sizes (raises `OSError`)."""
        for slot_bytes in classes:
            os.fdatasync(self.fd(slot_bytes))

    def punch(self, slot_bytes: int, runs: Sequence[tuple[int, int]]) -> None:
        """Give the space of freed slots (runs of (first slot, count)) back to the file
        system. Best effort: where holes cannot be punched the space stays allocated."""
        if _fallocate is None:
            return
        fd = self.fd(slot_bytes)
        for first, count in runs:
            if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, first * slot_bytes,
                          count * slot_bytes) != 0:
                return  # not supported here (or failing): keep the space

    def truncate_all(self) -> None:
        """Empty every data file of the directory (the index no longer names any slot)."""
        for name in os.listdir(self._dir):
            if name.startswith("slots-") and name.endswith(".kvd"):
                try:
                    size = int(name[len("slots-") : -len(".kvd")])
                except ValueError:
                    continue
                if file_name(size) == name:
                    os.ftruncate(self.fd(size), 0)

    def file_sizes(self) -> dict[int, int]:
        """Bytes of each data file in the directory, by slot size."""
        sizes = {}
        for name in os.listdir(self._dir):
            if name.startswith("slots-") and name.endswith(".kvd"):
                try:
                    size = int(name[len("slots-") : -len(".kvd")])
                    sizes[size] = os.path.getsize(os.path.join(self._dir, name))
                except (ValueError, OSError):
                    continue
        return sizes

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
