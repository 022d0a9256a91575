"""The router's own block keys: a chain over token ids, independent of any publisher's hashes.

key_0 = xxh3_64(ROOT || tokens_0 || extras_0), key_i = xxh3_64(key_{i-1} || tokens_i ||
extras_i), tokens as little-endian uint32, keys as 8 little-endian bytes when chained. The
extras are the canonical msgpack of what besides tokens makes a block's KV distinct and can
be expressed in a `/lookup`: a cache salt (first block only) and a LoRA adapter name (every
block). A publisher's block is indexed under the key computed from its parent's key and its
own token ids, so a query is hashed once per block size, whatever hashes publishers use.
"""

from __future__ import annotations

import msgpack
import numpy as np
import xxhash

ROOT = 0


def extras(salt: str | None, lora: str | None, first: bool) -> bytes:
    """Canonical extras of one block (b"" for none)."""
    items: list[list[str]] = []
    if first and salt is not None:
        items.append(["salt", salt])
    if lora is not None:
        items.append(["lora", lora])
    return msgpack.packb(items, use_bin_type=True) if items else b""


def block_key(parent: int, tokens: bytes, extra: bytes = b"") -> int:
    """The key of a block after the block keyed `parent` (ROOT for a first block)."""
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + tokens + extra)


def chain(tokens: np.ndarray, block_size: int, salt: str | None = None, lora: str | None = None) -> list[int]:
    """Keys of every full block of `tokens` (validated uint32)."""
    buf = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    out: list[int] = []
    parent = ROOT
    later = extras(salt, lora, False)
    for i in range(len(tokens) // block_size):
        parent = block_key(parent, buf[i * step : (i + 1) * step], extras(salt, lora, True) if i == 0 else later)
        out.append(parent)
    return out
