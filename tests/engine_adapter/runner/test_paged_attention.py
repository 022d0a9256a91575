"""Paged attention and ForwardBatch: equal to dense causal attention, through any block table."""

from __future__ import annotations

import math

import pytest
import torch

from engine_adapter.runner.forward_batch import NO_BLOCK, ForwardBatch, RequestChunk
from engine_adapter.runner.paged_attention import (
    allocate_kv_cache,
    attend,
    attend_chunked,
    attend_fused,
    attend_sdpa,
    check_kv_cache,
    gather_kv,
    kv_cache_shape,
    paged_attention,
    write_kv,
)
from kvstore.config import KVLayout
from kvstore.errors import InvalidInputError, LayoutMismatchError


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: explicit softmax; query j sits at position len(k) - len(q) + j."""
    q_len, num_heads, head_dim = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).to(torch.float64)
    v = v.repeat_interleave(group, dim=1).to(torch.float64)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float64), k) / math.sqrt(head_dim)
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    scores = scores.masked_fill(torch.arange(ctx_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("q_len,ctx_len", [(1, 1), (1, 9), (5, 5), (3, 11), (7, 7)])
def test_attend_matches_dense(num_heads: int, num_kv_heads: int, q_len: int, ctx_len: int) -> None:
    gen = torch.Generator().manual_seed(q_len * 100 + ctx_len)
    q = torch.randn(q_len, num_heads, 16, generator=gen)
    k = torch.randn(ctx_len, num_kv_heads, 16, generator=gen)
    v = torch.randn(ctx_len, num_kv_heads, 16, generator=gen)
    expected = dense_attention(q, k, v)
    torch.testing.assert_close(attend(q, k, v, 16**-0.5), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend_sdpa(q, k, v, 16**-0.5), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend_fused(q, k, v, 16**-0.5), expected, atol=1e-5, rtol=1e-5)
    for max_score_bytes in (1, 4 * num_heads * ctx_len * 2, 1 << 30):  # 1, 2, all rows a chunk
        out = attend_chunked(q, k, v, 16**-0.5, max_score_bytes)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def make_batch(
    lengths: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int
) -> tuple[ForwardBatch, list[list[int]]]:
    """A batch of requests (num_computed, num_new) over shuffled, disjoint block ids."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks, tables = [], []
    for computed, new in lengths:
        need = -(-(computed + new) // block_size)
        table, perm = perm[:need], perm[need:]
        tables.append(table)
        chunks.append(RequestChunk(list(range(new)), computed, table))
    return ForwardBatch.build(chunks, block_size), tables


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_paged_attention_equals_dense_for_mixed_batch(num_heads: int, num_kv_heads: int) -> None:
    block_size, num_blocks, head_dim, layer = 4, 24, 8, 1
    # (already computed, fed now): decode, full prefill, suffix prefill, partial-block prefix.
    lengths = [(8, 1), (0, 13), (12, 5), (6, 3), (0, 1)]
    batch, tables = make_batch(lengths, block_size, num_blocks, seed=3)
    layout = KVLayout(2, num_kv_heads, head_dim, torch.float32)
    # NaN everywhere: a read of any slot outside a request's context would poison its output.
    kv_cache = allocate_kv_cache(layout, num_blocks, block_size).fill_(float("nan"))
    gen = torch.Generator().manual_seed(0)
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in lengths]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in lengths]
    for (computed, _), table, k, v in zip(lengths, tables, full_k, full_v, strict=True):
        if computed:  # the prefix's KV is already in the request's blocks
            slots = torch.tensor(
                [table[p // block_size] * block_size + p % block_size for p in range(computed)]
            )
            write_kv(kv_cache, layer, k[:computed], v[:computed], slots)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen)
    new_k = torch.cat([k[c:] for (c, _), k in zip(lengths, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(lengths, full_v, strict=True)])

    out = paged_attention(q, new_k, new_v, kv_cache, layer, batch, head_dim**-0.5)

    for i, (start, (computed, new)) in enumerate(zip(batch.query_starts, lengths, strict=True)):
        expected = dense_attention(q[start : start + new], full_k[i], full_v[i])
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        keys, values = gather_kv(kv_cache, layer, torch.tensor(tables[i]), computed + new)
        torch.testing.assert_close(keys, full_k[i], atol=0, rtol=0)
        torch.testing.assert_close(values, full_v[i], atol=0, rtol=0)
    assert kv_cache[0].isnan().all(), "another layer was written"


def test_write_kv_touches_only_its_slots() -> None:
    layout = KVLayout(2, 2, 4, torch.float32)
    kv_cache = allocate_kv_cache(layout, 5, 3)
    k, v = torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0)
    write_kv(kv_cache, 1, k, v, torch.tensor([7, 14]))  # block 2 offset 1, block 4 offset 2
    assert (kv_cache[1, 0, 2, 1] == 1).all() and (kv_cache[1, 1, 4, 2] == 2).all()
    assert kv_cache.sum() == 2 * 8 * 1 + 2 * 8 * 2


def test_build_slot_mapping_formula() -> None:
    batch = ForwardBatch.build(
        [RequestChunk([5, 6, 7], 2, [9, 4, 6]), RequestChunk([8], 4, [1, 0, 3])], block_size=2
    )
    assert batch.input_ids.tolist() == [5, 6, 7, 8]
    assert batch.positions.tolist() == [2, 3, 4, 4]
    assert batch.slot_mapping.tolist() == [8, 9, 12, 6]
    assert batch.query_lens == (3, 1) and batch.context_lens == (5, 5)
    assert batch.query_starts == (0, 3) and batch.last_token_indices.tolist() == [2, 3]
    assert batch.block_tables.tolist() == [[9, 4, 6], [1, 0, 3]]
    assert batch.max_block_id == 9


def test_build_pads_block_tables_and_ignores_extra_blocks() -> None:
    batch = ForwardBatch.build(
        [RequestChunk([1], 0, [2, 7, 8]), RequestChunk([1, 2, 3], 0, [5, 6])], block_size=2
    )
    assert batch.block_tables.tolist() == [[2, NO_BLOCK], [5, 6]]
    assert batch.max_block_id == 6


@pytest.mark.parametrize(
    "chunks,message",
    [
        ([], "at least one request"),
        ([RequestChunk([], 0, [0])], "feeds no token"),
        ([RequestChunk([1, 2, 3], 0, [0])], "1 blocks cannot hold 3 tokens"),
        ([RequestChunk([1], -1, [0])], "num_computed_tokens=-1"),
        ([RequestChunk([-1], 0, [0])], "must be >= 0"),
        ([RequestChunk([1], 0, [-2])], "must be >= 0"),
        ([RequestChunk([1], 0, [3]), RequestChunk([1], 0, [3])], "same KV slot"),
    ],
)
def test_build_rejects(chunks: list[RequestChunk], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        ForwardBatch.build(chunks, block_size=2)


def test_build_rejects_bad_block_size() -> None:
    with pytest.raises(InvalidInputError, match="block_size"):
        ForwardBatch.build([RequestChunk([1], 0, [0])], block_size=0)


def test_check_kv_cache() -> None:
    layout = KVLayout(2, 2, 4, torch.float32)
    batch = ForwardBatch.build([RequestChunk([1, 2, 3], 0, [1, 3])], block_size=2)
    check_kv_cache(allocate_kv_cache(layout, 4, 2), layout, batch)
    with pytest.raises(InvalidInputError, match="block 3 of a cache with 3 blocks"):
        check_kv_cache(allocate_kv_cache(layout, 3, 2), layout, batch)
    with pytest.raises(LayoutMismatchError, match="expected"):
        check_kv_cache(allocate_kv_cache(layout, 4, 4), layout, batch)  # block size 4, not 2
    with pytest.raises(LayoutMismatchError, match="expected"):
        check_kv_cache(allocate_kv_cache(layout, 4, 2).to(torch.bfloat16), layout, batch)
    with pytest.raises(LayoutMismatchError, match="contiguous"):
        wide = torch.zeros(2, 2, 4, 2, 2, 8)[..., :4]
        check_kv_cache(wide, layout, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_attention_on_cuda_matches_cpu() -> None:
    block_size, num_blocks, head_dim = 16, 40, 64
    lengths = [(32, 1), (0, 70), (48, 20)]
    batch, tables = make_batch(lengths, block_size, num_blocks, seed=5)
    layout = KVLayout(1, 2, head_dim, torch.float32)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, 8, head_dim, generator=gen)
    k = torch.randn(batch.num_tokens, 2, head_dim, generator=gen)
    v = torch.randn(batch.num_tokens, 2, head_dim, generator=gen)
    cache_cpu = torch.randn(kv_cache_shape(layout, num_blocks, block_size), generator=gen)
    cache_gpu = cache_cpu.cuda()
    chunks = [RequestChunk(list(range(n)), c, t) for (c, n), t in zip(lengths, tables, strict=True)]
    batch_gpu = ForwardBatch.build(chunks, block_size, device="cuda")
    out_cpu = paged_attention(q, k, v, cache_cpu, 0, batch, head_dim**-0.5)
    out_gpu = paged_attention(q.cuda(), k.cuda(), v.cuda(), cache_gpu, 0, batch_gpu, head_dim**-0.5)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=2e-3, rtol=2e-3)  # TF32 matmuls
    torch.testing.assert_close(cache_gpu.cpu(), cache_cpu, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q_len,ctx_len", [(4096, 4096), (33, 8192), (2048, 6144)])
def test_fused_attention_on_cuda_long_context(q_len: int, ctx_len: int) -> None:
    """Long prefills on CUDA use fused kernels (no [q_len, ctx_len] scores); same result as
    the chunked reference in float32 within bf16-kernel rounding."""
    gen = torch.Generator(device="cuda").manual_seed(ctx_len)
    q = torch.randn(q_len, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(ctx_len, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(ctx_len, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = attend(q, k, v, 128**-0.5)
    ref = attend_chunked(q.float(), k.float(), v.float(), 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
