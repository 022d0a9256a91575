"""Deterministic KV and prompts, so any process can recompute the bytes a prefix must return.

A block's bytes are drawn from a generator seeded by xxh64 of (namespace tag, the whole token
prefix up to the block's end): the same prefix gives the same bytes in every process, and a
block returned for the wrong prefix, salt or namespace does not match. Bytes are compared raw
(random bit patterns include NaNs, which `torch.equal` would call unequal).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from bench.soak_kv import block_bytes
from kvstore import KVCacheStore, KVLayout, StoreConfig

# 4 KiB blocks: each LMDB record spills into overflow pages, as real blocks do.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
BLOCK = 16
# 256-byte blocks for tests that need many of them (records live inside LMDB leaf pages).
SMALL_LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float16)
SMALL_BLOCK = 4


def make_kv(tokens: np.ndarray, layout: KVLayout, block_size: int, tag: str = "") -> torch.Tensor:
    """KV `[L, 2, len(tokens), H, D]` whose full blocks are `block_bytes` of their prefixes."""
    n = len(tokens)
    num_full = n // block_size
    b = block_size
    parts = [block_bytes(tokens[: (i + 1) * b], layout, b, tag) for i in range(num_full)]
    tail = n - num_full * block_size
    if tail:
        seed = xxhash.xxh64_intdigest(b"tail" + np.ascontiguousarray(tokens, "<u4").tobytes())
        parts.append(np.random.Generator(np.random.PCG64(seed)).bytes(layout.token_bytes * tail))
    blocks = [
        torch.frombuffer(bytearray(p), dtype=torch.uint8)
        .view(layout.dtype)
        .view(layout.block_shape(len(p) // layout.token_bytes))
        for p in parts
    ]
    if not blocks:
        return torch.empty(layout.block_shape(0), dtype=layout.dtype)
    return torch.cat(blocks, dim=2)


def check_kv(
    tokens: np.ndarray, kv: torch.Tensor | None, num_tokens: int, layout: KVLayout,
    block_size: int, tag: str = "",
) -> int:
    """Assert `kv` holds exactly the blocks of `tokens[:num_tokens]`; return how many blocks."""
    assert num_tokens % block_size == 0, f"num_tokens={num_tokens} is not whole blocks"
    assert num_tokens <= len(tokens)
    if num_tokens == 0:
        assert kv is None
        return 0
    assert kv is not None
    assert tuple(kv.shape) == layout.block_shape(num_tokens), kv.shape
    assert kv.dtype == layout.dtype
    for i in range(num_tokens // block_size):
        got = kv[:, :, i * block_size : (i + 1) * block_size].contiguous().view(torch.uint8)
        want = block_bytes(tokens[: (i + 1) * block_size], layout, block_size, tag)
        if got.numpy().tobytes() != want:
            raise AssertionError(f"block {i} of a {len(tokens)}-token prompt: bytes differ")
    return num_tokens // block_size


class PromptPool:
    """`num_prompts` reproducible prompts sharing `num_roots` common prefixes.

    Prompt j is root (j % num_roots) cut to a random number of blocks, then a tail of its own;
    lengths are not always whole blocks.
    """

    def __init__(
        self, seed: int, num_prompts: int, *, num_roots: int = 16, block_size: int = BLOCK,
        max_root_blocks: int = 8, max_tail_blocks: int = 6, vocab: int = 50_000,
    ) -> None:
        self.num_prompts = num_prompts
        self._seed = seed
        self._block = block_size
        self._max_tail = max_tail_blocks
        self._vocab = vocab
        rng = np.random.default_rng([seed, 0])
        self._roots = [
            rng.integers(0, vocab, size=max_root_blocks * block_size, dtype=np.uint32)
            for _ in range(num_roots)
        ]

    def prompt(self, j: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, 1, j])
        root = self._roots[j % len(self._roots)]
        cut = int(rng.integers(0, len(root) // self._block + 1)) * self._block
        tail_len = int(rng.integers(0, self._max_tail * self._block + 1))
        tail = rng.integers(0, self._vocab, size=tail_len, dtype=np.uint32)
        return np.concatenate([root[:cut], tail]).astype(np.uint32)


def open_store(disk_path: str | None, **overrides: object) -> KVCacheStore:
    """A store over LAYOUT/BLOCK; `overrides` are StoreConfig fields."""
    kwargs: dict[str, object] = {
        "layout": LAYOUT, "block_size": BLOCK, "cpu_bytes": 0, "disk_path": disk_path,
        "disk_bytes": 64 << 20, "disk_sync": False, "namespace": "reliability",
    }
    kwargs.update(overrides)
    return KVCacheStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def full_blocks(tokens: Sequence[int] | np.ndarray, block_size: int = BLOCK) -> int:
    return len(tokens) // block_size * block_size
