"""The soak's workload: prompts that share prefixes, and KV that is a pure function of its
namespace and token prefix, so any process can check any hit bit-exact without coordination.

A block's bytes come from a generator seeded by xxh64 of (namespace tag, the whole token
prefix up to the block's end): a block returned for another prefix or namespace differs.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvstore import KVLayout

# 4 KiB blocks: disk records spill into LMDB overflow pages and slot files, as real ones do.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
BLOCK = 16
NUM_DOCS = 24  # shared prefixes ("documents")
DOC_BLOCKS = 8
SUFFIXES = 6  # variants per document: 0..4 more blocks after it


def prompt(seed: int, doc: int, variant: int) -> np.ndarray:
    """Document `doc`'s tokens, then variant `variant`'s suffix (0: none); the same in every
    process for one `seed`."""
    base = np.random.Generator(np.random.PCG64([seed, doc])).integers(1, 50_000, DOC_BLOCKS * BLOCK, dtype=np.int64)
    if variant == 0:
        return base
    extra = np.random.Generator(np.random.PCG64([seed, doc, variant])).integers(
        1, 50_000, (variant % 4 + 1) * BLOCK, dtype=np.int64)
    return np.concatenate([base, extra])


def block_bytes(prefix: np.ndarray, layout: KVLayout = LAYOUT, block_size: int = BLOCK, tag: str = "") -> bytes:
    """The bytes of the block that ends `prefix` (a whole number of blocks) in namespace `tag`
    (`tests/reliability/` derives its KV the same way)."""
    data = tag.encode() + b"\x00" + np.ascontiguousarray(prefix, "<u4").tobytes()
    seed = xxhash.xxh64_intdigest(data)
    return np.random.Generator(np.random.PCG64(seed)).bytes(layout.block_bytes(block_size))


def make_kv(tokens: np.ndarray, tag: str) -> torch.Tensor:
    """KV `[L, 2, len(tokens), H, D]` (whole blocks) whose blocks are `block_bytes` of their prefixes."""
    blocks = [torch.frombuffer(bytearray(block_bytes(tokens[: (i + 1) * BLOCK], tag=tag)), dtype=torch.uint8)
              .view(LAYOUT.dtype).view(LAYOUT.block_shape(BLOCK)) for i in range(len(tokens) // BLOCK)]
    return torch.cat(blocks, dim=2)


def wrong_blocks(tokens: np.ndarray, kv: torch.Tensor | None, num_tokens: int, tag: str) -> int:
    """How many blocks of the hit `kv` (its first `num_tokens` tokens of `tokens`) differ from
    what their prefix must hold; a hit of part of a block counts as one wrong block."""
    if num_tokens == 0:
        return 0
    if kv is None or num_tokens % BLOCK or num_tokens > len(tokens) or kv.shape[2] < num_tokens:
        return 1
    wrong = 0
    for i in range(num_tokens // BLOCK):
        got = kv[:, :, i * BLOCK:(i + 1) * BLOCK].contiguous().view(torch.uint8).numpy().tobytes()
        wrong += got != block_bytes(tokens[: (i + 1) * BLOCK], tag=tag)
    return wrong
