"""A stand-in model runner for the manager tests: it "computes" KV by writing the bytes
`kvgen` derives from the token prefix into the request's pool blocks, and checks the blocks
it was handed (cached or loaded) hold exactly those bytes before it trusts them."""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from engine_adapter.runner.block_manager import KVCacheManager
from kvstore import ExtraKeys, KVLayout
from tiers.pool.gpu_pool import BlockPool, NoFreeBlocksError

from .kvgen import block_bytes


def write_blocks(pool: BlockPool, table: list[int], tokens: np.ndarray, first: int, last: int,
                 layout: KVLayout, block_size: int, tag: str = "") -> None:
    """Write the KV of full blocks `first..last-1` of `tokens` into their pool blocks."""
    for i in range(first, last):
        data = block_bytes(tokens[: (i + 1) * block_size], layout, block_size, tag)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(layout.dtype)
        pool.block_view(table[i]).copy_(src.view(layout.block_shape(block_size)))


def check_blocks(pool: BlockPool, table: list[int], tokens: np.ndarray, num_blocks: int,
                 layout: KVLayout, block_size: int, tag: str = "") -> None:
    """Assert pool blocks `table[:num_blocks]` hold the KV of `tokens`' first blocks."""
    for i in range(num_blocks):
        got = pool.block_view(table[i]).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        if got != block_bytes(tokens[: (i + 1) * block_size], layout, block_size, tag):
            raise AssertionError(f"pool block {table[i]} (block {i} of a {len(tokens)}-token "
                                 f"request) does not hold its prefix's KV")


def serve(mgr: KVCacheManager, rid: str, tokens: np.ndarray, layout: KVLayout, block_size: int,
          *, tag: str = "", extra_keys: ExtraKeys | None = None, num_decode: int = 0,
          between: object = None) -> tuple[int, int] | None:
    """Run one request through the manager as a runner would: add, find the cached prefix,
    allocate, check the reused blocks, compute the rest, commit, decode `num_decode` tokens
    (their ids are derived from the prefix), free. `between()` runs while the request holds
    its blocks (to let other threads in). Returns (reused tokens, blocks checked), or None
    if the pool had no room (the request is then freed, nothing held)."""
    pool = mgr.store.pool
    b = block_size
    mgr.add_request(rid, tokens, extra_keys)
    try:
        computed = mgr.get_computed_blocks(rid)
        try:
            alloc = mgr.allocate_slots(rid, len(tokens) - computed.num_tokens, computed)
        except NoFreeBlocksError:
            return None
        reused = alloc.num_computed_tokens
        # A `computed` that went stale (another thread evicted or stored blocks since) is
        # looked up again by `allocate_slots`, keeping the request's total fixed: the prefix it
        # reuses may then be longer than `computed` said, never past the last prompt token.
        assert reused % b == 0 and reused <= (len(tokens) - 1) // b * b
        table = mgr.block_table(rid)
        check_blocks(pool, table, tokens, reused // b, layout, b, tag)
        write_blocks(pool, table, tokens, reused // b, len(tokens) // b, layout, b, tag)
        if callable(between):
            between()
        # Nobody may have touched blocks this request holds.
        check_blocks(pool, table, tokens, len(tokens) // b, layout, b, tag)
        mgr.commit(rid, len(tokens))
        full = tokens
        for _ in range(num_decode):
            nxt = xxhash.xxh32_intdigest(full.tobytes()) & 0xFFFF
            full = np.append(full, np.uint32(nxt))
            mgr.append_tokens(rid, [nxt])
            try:
                mgr.allocate_slots(rid, 1)
            except NoFreeBlocksError:
                break
            table = mgr.block_table(rid)
            if len(full) % b == 0:
                write_blocks(pool, table, full, len(full) // b - 1, len(full) // b, layout, b, tag)
            mgr.commit(rid, len(full))
        check_blocks(pool, mgr.block_table(rid), full, len(full) // b, layout, b, tag)
        return reused, len(full) // b
    finally:
        mgr.free(rid)
