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
    was all (a fault, counted through `on_fault`, or the deadline stops it). Names are
    matched as listed, without a `stat` per file."""
    deleted = 0
    try:
        for ns_dir in ns_dirs:
            try:
                shards = files.shard_dirs(ns_dir)
            except FileNotFoundError:
                continue
            for path, aa in shards:
                for leaf, bb in _leaves(path):
                    deleted += _sweep_leaf(leaf, aa, bb)
                    with contextlib.suppress(OSError):  # not empty (a foreign file, a new block), or gone
                        os.rmdir(leaf)
                    if time.monotonic() > deadline:
                        return SweepResult(deleted, False)
                with contextlib.suppress(OSError):
                    os.rmdir(path)
    except OSError as exc:
        on_fault("clear", exc)
        return SweepResult(deleted, False)
    return SweepResult(deleted, True)


def _leaves(shard: str) -> list[tuple[str, str]]:
    try:
        with os.scandir(shard) as it:
            return [(e.path, e.name) for e in it if files.is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _sweep_leaf(leaf: str, aa: str, bb: str) -> int:
    """Unlink kvstrata's files in one leaf directory; how many went."""
    try:
        with os.scandir(leaf) as it:
            doomed = [e.path for e in it if e.is_file(follow_symlinks=False)
                      and (files.block_of(e.name, aa, bb) is not None or files.is_temp(e.name, aa, bb))]
    except FileNotFoundError:
        return 0
    n = 0
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            n += 1
    return n
