"""One block file's I/O on the shared directory: the whole-file read, the write to a temporary
name renamed into place, the recency touch, the removal of a file read as damaged.

A reader never sees part of a block: a writer writes `<leaf>/.<hash>.<host>.<pid>.<random>.tmp`
and renames it over `<hash>.kvb` (atomic on POSIX filesystems and on NFS within one
directory); a writer killed before the rename leaves only its temporary file, which the
space's scan removes once it is `orphan_after_s` old. Every call raises `OSError` on a fault
of the filesystem; the tier counts it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tiers.keys import BlockHash
from tiers.sharedfs import files


class Read(NamedTuple):
    """A file read whole: its bytes, and what identifies the version read (device, inode,
    size, mtime in ns), to remove exactly that version if it proves damaged."""

    data: memoryview  # writable (uninitialized memory read into, not zeroed first)
    version: tuple[int, int, int, int]
    mtime: float


class TooLong(Exception):
    """The file is longer than any record of this layout: refused unread."""

    def __init__(self, version: tuple[int, int, int, int]) -> None:
        super().__init__("a file longer than any record of this layout")
        self.version = version


def read_file(path: str, limit: int) -> Read | None:
    """The whole file at `path` (None if absent); `TooLong` if it is over `limit` bytes.
    A file that changes size while it is read reads short or long: its record then fails
    its own checks (a counted miss)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size > limit:
            raise TooLong(version)
        buf = np.empty(st.st_size + 1, dtype=np.uint8).data  # one byte more: a file grown since shows
        got = 0
        while got < len(buf):
            n = os.readv(fd, [buf[got:]])
            if not n:
                break
            got += n
        data = buf[:got]
        return Read(data, version, st.st_mtime)
    finally:
        os.close(fd)


def touch_if_older(path: str, mtime: float, after_s: float) -> bool:
    """Mark the file used now (`utime`) if its mtime is `after_s` old: recency for the
    space's eviction, at most one metadata write per file per `after_s`. Absent: False."""
    if time.time() - mtime < after_s:
        return False
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


def remove_version(path: str, version: tuple[int, int, int, int]) -> bool:
    """Remove the file at `path` if it is still the version read (a writer may have renamed
    a sound one over it since); whether it was removed."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != version:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def write_file(ns_dir: str, block_hash: BlockHash, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write `parts`, one after the other, as the file of `block_hash`: to a temporary name in its leaf directory,
    renamed into place (creating the shard directories as needed, again if a clear removed
    them meanwhile). The temporary file is removed if the write fails."""
    leaf = files.leaf_dir(ns_dir, block_hash)
    for attempt in range(2):
        tmp = os.path.join(leaf, files.temp_name(block_hash))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileNotFoundError:
            if attempt:
                raise
            os.makedirs(leaf, exist_ok=True)
            continue
        try:
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, files.block_path(ns_dir, block_hash))
            return
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
