"""The shared directory's naming scheme: where a block's file lives, what a writer's temporary
file is called, and which names are kvstrata's (nothing else is ever deleted).

    <root>/<namespace: 32 hex>/<aa>/<bb>/<block hash hex>.kvb       a block (aa, bb: its first 4 hex)
    <root>/<namespace>/<aa>/<bb>/.<hash hex>.<host>.<pid>.<16 hex>.tmp   a write in progress

A name is kvstrata's only if it matches its pattern *and* sits where the pattern says (the
shard directories named by the hash's own first hex digits): a file that merely ends in
`.kvb` elsewhere is foreign.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from typing import NamedTuple

import xxhash

from tiers.keys import BlockHash

BLOCK_SUFFIX = ".kvb"
_HEX = re.compile(r"[0-9a-f]{2}\Z")
_NAMESPACE = re.compile(r"[0-9a-f]{32}\Z")
_BLOCK = re.compile(r"([0-9a-f]{8,128})\.kvb\Z")
_TEMP = re.compile(r"\.([0-9a-f]{8,128})\.[A-Za-z0-9-]{1,32}\.[0-9]{1,10}\.[0-9a-f]{16}\.tmp\Z")
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def namespace_dir_name(namespace: bytes) -> str:
    """The directory (32 hex) of a store's namespace seed under the root."""
    return xxhash.xxh3_128_hexdigest(bytes(namespace))


def is_namespace_dir_name(name: str) -> bool:
    return bool(_NAMESPACE.match(name))


def is_shard_name(name: str) -> bool:
    return bool(_HEX.match(name))


def leaf_dir(ns_dir: str, block_hash: BlockHash) -> str:
    """The shard directory of `block_hash` under a namespace directory."""
    h = bytes(block_hash).hex()
    return os.path.join(ns_dir, h[:2], h[2:4])


def block_path(ns_dir: str, block_hash: BlockHash) -> str:
    """The file of `block_hash` under a namespace directory."""
    return os.path.join(leaf_dir(ns_dir, block_hash), bytes(block_hash).hex() + BLOCK_SUFFIX)


def temp_name(block_hash: BlockHash) -> str:
    """A temporary name for a write of `block_hash`, unique to this host, process and call."""
    return f".{bytes(block_hash).hex()}.{_HOST}.{os.getpid()}.{os.urandom(8).hex()}.tmp"


def _in_place(hex_hash: str, aa: str, bb: str) -> bool:
    return hex_hash[:2] == aa and hex_hash[2:4] == bb


def block_of(name: str, aa: str, bb: str) -> BlockHash | None:
    """The block hash a file `name` in shard `aa/bb` holds, if it is a kvstrata block file there."""
    m = _BLOCK.match(name)
    if m is None or len(m.group(1)) % 2 or not _in_place(m.group(1), aa, bb):
        return None
    return BlockHash(bytes.fromhex(m.group(1)))


def is_temp(name: str, aa: str, bb: str) -> bool:
    """Whether `name` in shard `aa/bb` is a kvstrata writer's temporary file."""
    m = _TEMP.match(name)
    return m is not None and _in_place(m.group(1), aa, bb)


class Entry(NamedTuple):
    """One kvstrata file found in a shard directory."""

    path: str
    block_hash: BlockHash | None  # None: a temporary file
    size: int
    mtime: float


def shard_dirs(ns_dir: str) -> list[tuple[str, str]]:
    """The (path, name) of the top-level shard directories of a namespace directory, sorted."""
    with os.scandir(ns_dir) as it:
        return sorted((e.path, e.name) for e in it if is_shard_name(e.name) and e.is_dir(follow_symlinks=False))


def scan_leaf(path: str, aa: str, bb: str) -> Iterator[Entry]:
    """The kvstrata files (blocks and temporary files) of one leaf directory `aa/bb`; files
    that vanish while being listed are skipped; foreign ones are never yielded."""
    with os.scandir(path) as it:
        for e in it:
            block = block_of(e.name, aa, bb)
            if block is None and not is_temp(e.name, aa, bb):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not e.is_file(follow_symlinks=False):
                continue
            yield Entry(e.path, block, st.st_size, st.st_mtime)


def scan_shard(path: str, aa: str) -> Iterator[Entry]:
    """The kvstrata files of every leaf of a top-level shard directory `aa`."""
    with os.scandir(path) as it:
        leaves = [(e.path, e.name) for e in it if is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]
    for leaf, bb in leaves:
        try:
            yield from scan_leaf(leaf, aa, bb)
        except FileNotFoundError:  # removed meanwhile (a clear elsewhere)
            continue


def namespace_dirs(root: str) -> list[str]:
    """The namespace directories under the root, sorted."""
    with os.scandir(root) as it:
        return sorted(e.path for e in it if is_namespace_dir_name(e.name) and e.is_dir(follow_symlinks=False))
