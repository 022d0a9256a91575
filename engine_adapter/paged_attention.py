"""Attention over a paged KV cache, read and written through per-request block tables.

The cache layout is fixed by the block pool: one tensor `kv_cache` of shape
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 = K, 1 = V), so
that `kv_cache[:, :, block_id]` is one kvstrata block `[num_layers, 2, block_size,
num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_adapter.forward_batch import ForwardBatch
from kvstore.config import KVLayout
from kvstore.errors import InvalidInputError, LayoutMismatchError


def kv_cache_shape(
    layout: KVLayout, num_blocks: int, block_size: int
) -> tuple[int, int, int, int, int, int]:
    """Shape of a paged KV cache of `num_blocks` blocks of `block_size` tokens."""
    return (layout.num_layers, 2, num_blocks, block_size, layout.num_kv_heads, layout.head_dim)


def allocate_kv_cache(
    layout: KVLayout, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zeroed paged KV cache (for tests and benchmarks; the block pool owns the real one)."""
    shape = kv_cache_shape(layout, num_blocks, block_size)
    return torch.zeros(shape, dtype=layout.dtype, device=device)


def check_kv_cache(kv_cache: torch.Tensor, layout: KVLayout, batch: ForwardBatch) -> None:
    """Check that `kv_cache` has `layout`, the batch's block size, and every block it uses.

    Raises:
        LayoutMismatchError: wrong shape, dtype or non-contiguous storage.
        InvalidInputError: the batch uses a block id the cache does not have.
    """
    if kv_cache.dim() != 6:
        raise LayoutMismatchError(f"kv_cache must be 6-D, got shape {tuple(kv_cache.shape)}")
    expected = kv_cache_shape(layout, kv_cache.shape[2], batch.block_size)
    if tuple(kv_cache.shape) != expected or kv_cache.dtype != layout.dtype:
        raise LayoutMismatchError(
            f"kv_cache is {tuple(kv_cache.shape)} {kv_cache.dtype}, expected {expected} "
            f"{layout.dtype}"
        )
    if not kv_cache.is_contiguous():
        raise LayoutMismatchError("kv_cache must be contiguous")
    if batch.max_block_id >= kv_cache.shape[2]:
        raise InvalidInputError(
            f"batch uses block {batch.max_block_id} of a cache with {kv_cache.shape[2]} blocks"
        )


def write_kv(
    kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `k`, `v` `[num_tokens, num_kv_heads, head_dim]` into `layer`'s slots, in place.

    Token `t` goes to slot `slot_mapping[t]` (= block_id * block_size + offset); nothing
    else in the cache changes.
    """
    _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = kv_cache[layer].view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[context_len, num_kv_heads, head_dim]` of one request, read through its blocks."""
    kv = kv_cache[layer][:, block_ids]  # [2, n_blocks, block_size, heads, dim], a copy
    kv = kv.flatten(1, 2)[:, :context_len]
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the batch's fed tokens over each request's whole context.

    Writes the new `k`, `v` `[num_tokens, num_kv_heads, head_dim]` into the request slots of
    `layer` first, then attends each request's queries `q` `[num_tokens, num_heads,
    head_dim]` to the K/V of positions `0 .. position` read back from its blocks (grouped-
    query: query head `h` uses KV head `h // (num_heads // num_kv_heads)`).

    Returns:
        `[num_tokens, num_heads, head_dim]`, in q's dtype.
    """
    write_kv(kv_cache, layer, k, v, batch.slot_mapping)
    out = torch.empty_like(q)
    for i, (start, q_len, ctx_len) in enumerate(
        zip(batch.query_starts, batch.query_lens, batch.context_lens, strict=True)
    ):
        num_blocks = -(-ctx_len // batch.block_size)
        keys, values = gather_kv(kv_cache, layer, batch.block_tables[i, :num_blocks], ctx_len)
        out[start : start + q_len] = attend(q[start : start + q_len], keys, values, scale)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last `len(q)` positions of one sequence over all of its `len(k)`.

    `q` is `[q_len, num_heads, head_dim]`, `k`/`v` are `[ctx_len, num_kv_heads, head_dim]`
    with `q_len <= ctx_len`; query `j` sits at position `ctx_len - q_len + j`. Returns
    `[q_len, num_heads, head_dim]`.
    """
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if group > 1:  # GQA: fold each KV head's query heads into its query rows; K/V not copied.
        qh = q.reshape(q_len, num_kv_heads, group, -1).permute(1, 2, 0, 3).flatten(1, 2)
    else:
        qh = q.transpose(0, 1)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    if q_len == 1:  # a single query at the last position sees everything
        mask = None
    else:
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
        if group > 1:
            mask = mask.repeat(group, 1)
    if q_len == ctx_len and group == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    if group > 1:
        return out.unflatten(1, (group, q_len)).permute(2, 0, 1, 3).reshape(q_len, num_heads, -1)
    return out.transpose(0, 1)
