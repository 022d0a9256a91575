"""One LMDB environment (the disk tier's index) per directory per process, shared by
reference count.

LMDB forbids opening one file twice in a process, so every disk tier on a directory shares
one `lmdb.Environment`. This module opens it (turning every way an open can fail into a
`ConfigError` that leaves other stores untouched), grows its map only when the address
space can take it, checks the data file against its meta page (a truncated file would
otherwise kill the process with SIGBUS on first touch), and drops, in a forked child, the
handles the parent opened (LMDB handles must not cross `fork()`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import resource
from typing import Any

import lmdb

from tiers.errors import ConfigError
from tiers.shared.process_objects import ProcessRegistry

# Largest map an open accepts: far beyond any disk, inside a 47-bit user address space.
MAX_MAP_BYTES = 1 << 46


def _close_in_child(env: lmdb.Environment) -> None:
    with contextlib.suppress(lmdb.Error):
        env.close()  # unmaps and closes this process's copies of the fds only


_ENVS: ProcessRegistry[str, lmdb.Environment] = ProcessRegistry(forget_in_child=_close_in_child)  # by realpath


def _check_address_space(map_size: int, path: str) -> None:
    """Reserve (and release) `map_size` bytes of address space, or raise `ConfigError`."""
    try:
        probe = mmap.mmap(-1, map_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
                          prot=0)  # PROT_NONE: address space only
    except (OSError, OverflowError, ValueError, MemoryError) as exc:
        raise ConfigError(
            f"disk tier at {path!r}: a map of {map_size} bytes does not fit this process's address space ({exc}); "
            "lower disk_bytes"
        ) from None
    probe.close()


class TruncatedIndexError(ConfigError):
    """`data.mdb` is shorter than its meta page says: nothing in it may be touched."""


def _check_data_file(env: lmdb.Environment, real: str) -> None:
    """The data file must hold every page its meta page says is in use (`TruncatedIndexError`)."""
    info, stat = env.info(), env.stat()
    need = (info["last_pgno"] + 1) * stat["psize"]
    try:
        size = os.path.getsize(os.path.join(real, "data.mdb"))
    except OSError:
        return  # a subdir-less layout or a file that is not there: LMDB itself reports it
    if size < need:
        raise TruncatedIndexError(
            f"disk tier at {real!r}: data.mdb holds {size} bytes but its meta page uses {need}: the file was "
            "truncated; move it away (or delete it) to start an empty disk tier"
        )


def acquire_env(path: str, map_size: int, sync: bool) -> tuple[str, lmdb.Environment]:
    """The process's environment for `path` (opened, or its map grown to `map_size`).

    Raises `ConfigError` (leaving every open store as it was) for a path that cannot be a
    directory or holds no usable LMDB, a map the address space cannot take, or a data file
    shorter than its meta page says.
    """
    if not 0 < map_size <= MAX_MAP_BYTES:
        raise ConfigError(f"disk tier at {path!r}: map size {map_size} outside (0, {MAX_MAP_BYTES}]")
    try:
        os.makedirs(path, exist_ok=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"disk_path {path!r} cannot be made a directory: {exc}") from None
    real = os.path.realpath(path)

    def grow(env: lmdb.Environment) -> None:
        if env.info()["map_size"] < map_size:
            _check_address_space(map_size, path)
            try:
                env.set_mapsize(map_size)
            except (lmdb.Error, MemoryError, OverflowError) as exc:
                raise ConfigError(f"disk tier at {path!r}: cannot grow the map to {map_size}: {exc}") from None

    def open_env() -> lmdb.Environment:
        _check_address_space(map_size, path)
        try:
            env = lmdb.open(
                real, map_size=map_size, max_dbs=8, max_readers=1024,
                sync=sync, metasync=sync, readahead=True, meminit=False, lock=True,
            )
        except (lmdb.Error, MemoryError, OverflowError, ValueError) as exc:
            raise ConfigError(f"disk_path {path!r} holds no usable LMDB store: {exc}") from None
        try:
            _check_data_file(env, real)
            env.reader_check()  # slots left by processes killed mid-read pin freed pages
        except BaseException:
            env.close()
            raise
        return env

    return real, _ENVS.acquire(real, open_env, on_share=grow)


def open_read_only(path: str) -> lmdb.Environment:
    """A read-only open of the LMDB environment under `path` (readers take no writer lock;
    not shared, the caller closes it), checked as `acquire_env` checks its own. Raises
    `ConfigError` if there is none, `TruncatedIndexError` if its data file is shorter than
    its meta page says (touching the missing pages would kill the process with SIGBUS)."""
    real = os.path.realpath(path)
    try:
        env = lmdb.open(real, readonly=True, lock=True, max_dbs=8, create=False)
    except (lmdb.Error, MemoryError, OverflowError, ValueError) as exc:
        why = str(exc)
        with contextlib.suppress(OSError):
            why = f"data.mdb of {os.path.getsize(os.path.join(real, 'data.mdb'))} bytes: {why}"
        raise ConfigError(f"{path!r} is not a readable LMDB environment ({why})") from None
    try:
        _check_data_file(env, real)
    except BaseException:
        env.close()
        raise
    return env


def release_env(real: str) -> None:
    """Drop one reference; the last one closes the environment."""
    _ENVS.release(real, lambda env: env.close())


def begin(env: lmdb.Environment, *, db: Any = None, write: bool = False, buffers: bool = False) -> Any:
    """`env.begin(...)`, adopting a map another process grew meanwhile. Returns the
    transaction (`lmdb.Transaction`, whose value type depends on `buffers`)."""
    for attempt in range(2):
        try:
            return env.begin(db=db, write=write, buffers=True) if buffers else env.begin(db=db, write=write)
        except lmdb.MapResizedError:
            if attempt:
                raise
            env.set_mapsize(0)  # 0: take the size the file now has
    raise AssertionError("unreachable")


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXTS = ("No space left", "quota exceeded", "File too large")


def disk_full_reason(exc: BaseException, path: str, num_bytes: int) -> str | None:
    """Why a failed LMDB write was for want of room, or None if it was not.

    LMDB reports a short write as EIO ("Input/output error"): that is what a file system
    that fills, or a file-size limit, does mid-commit. EIO counts as full only when the free
    space or the RLIMIT_FSIZE headroom is below `num_bytes` (plus slack) right after.
    """
    text = str(exc)
    if getattr(exc, "errno", None) in _FULL_ERRNOS or any(t in text for t in _FULL_TEXTS):
        return "file system full"
    if "Input/output error" not in text:
        return None
    need = num_bytes + (4 << 20)
    try:
        st = os.statvfs(path)
        if st.f_bavail * st.f_frsize < need:
            return "file system full (LMDB saw a short write)"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            size = os.path.getsize(os.path.join(path, "data.mdb"))
            if size + need > limit:
                return f"file size limit of {limit} bytes reached (LMDB saw a short write)"
    except OSError:
        return None
    return None
