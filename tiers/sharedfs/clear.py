"""Listing and clearing namespace directories of the shared directory, bounded in time;
only kvstrata's files (`files.py`) are listed or removed, and only shard directories left
empty are removed (`rmdir` refuses one that holds anything, a foreign file included)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from tiers.base import SweepResult
from tiers.keys import BlockHash
from tiers.sharedfs import files


def walk_blocks(ns_dir: str, found: list[BlockHash], limit: int, deadline: float) -> None:
    """Append the blocks of a namespace directory to `found`, at most `limit`, until
    `deadline` (monotonic); raises `OSError` on a fault (what was found stays in `found`)."""
    try:
        shards = files.shard_dirs(ns_dir)
    except FileNotFoundError:
        return
    for path, aa in shards:
        for entry in files.scan_shard(path, aa):
            if entry.block_hash is not None:
                found.append(entry.block_hash)
            if len(found) >= limit or time.monotonic() > deadline:
                return


def sweep_dirs(ns_dirs: list[str], deadline: float, on_fault: Callable[[str, OSError], None]) -> SweepResult:
    """Remove the block and temporary files of each namespace directory and the shard
    directories they leave empty, until `deadline`; how many files went and whether that
    was all (a fault, counted through `on_fault`, or the deadline stops it)."""
    deleted = 0
    try:
        for ns_dir in ns_dirs:
            try:
                shards = files.shard_dirs(ns_dir)
            except FileNotFoundError:
                continue
            for path, aa in shards:
                for entry in files.scan_shard(path, aa):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        deleted += 1
                    if time.monotonic() > deadline:
                        return SweepResult(deleted, False)
                _remove_empty(path)
    except OSError as exc:
        on_fault("clear", exc)
        return SweepResult(deleted, False)
    return SweepResult(deleted, True)


def _remove_empty(shard: str) -> None:
    """rmdir the shard's leaf directories and then the shard, each only if empty (a writer
    that finds its leaf gone makes it again)."""
    with os.scandir(shard) as it:
        leaves = [e.path for e in it if files.is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]
    for leaf in [*leaves, shard]:
        with contextlib.suppress(OSError):  # not empty (a foreign file, a new block), or gone
            os.rmdir(leaf)
