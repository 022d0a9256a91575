"""Checks on the tensors callers hand to the store: usable, of the layout, not aliased.

Every check raises an `InvalidInputError` subclass naming the bad value and changes nothing,
so a public call can validate all of its tensors before it touches any tier.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, LayoutMismatchError
from tiers.shared.blockbatch import BlockBatch

_MAX_RUNS = 1 << 22  # byte runs enumerated to prove tensors disjoint


def check_usable(t: object, what: str) -> torch.Tensor:
    """`t` as a dense tensor whose elements all lie inside its storage.

    Refuses non-tensors, sparse/quantized/nested tensors, meta tensors, and views that
    reach past their storage (e.g. one whose storage was resized to 0).
    """
    if not isinstance(t, torch.Tensor):
        raise LayoutMismatchError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False):
        raise LayoutMismatchError(f"{what} must be a dense strided tensor, got layout {t.layout}"
                                  f"{' (quantized)' if t.is_quantized else ''}")
    if t.device.type == "meta":
        raise LayoutMismatchError(f"{what} is a meta tensor: it holds no data")
    if t.numel():
        reach = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1) + 1
        if any(s < 0 for s in t.stride()) or reach * t.element_size() > t.untyped_storage().nbytes():
            raise LayoutMismatchError(f"{what} reaches past its storage ({t.untyped_storage().nbytes()} bytes)")
    return t


def check_writable(t: torch.Tensor, what: str) -> None:
    """Refuse a destination an in-place copy cannot write (a leaf that requires grad)."""
    if t.requires_grad and t.is_leaf:
        raise InvalidInputError(f"{what} requires grad: kvstrata cannot write KV into it")


def _runs(t: torch.Tensor) -> np.ndarray | None:
    """Byte ranges `[start, end)` covered by `t`'s elements, one row per contiguous run;
    None if there are too many to list."""
    es = t.element_size()
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    run = 1
    i = 0
    while i < len(dims) and dims[i][0] == run:
        run *= dims[i][1]
        i += 1
    outer = dims[i:]
    count = int(np.prod([n for _, n in outer])) if outer else 1
    if count > _MAX_RUNS:
        return None
    starts = np.zeros(1, dtype=np.int64)
    for stride, n in outer:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    starts = starts * es + t.data_ptr()
    return np.stack([starts, starts + run * es], axis=1)


def _spread(t: torch.Tensor) -> bool:
    """Whether no two elements of `t` share memory by its strides alone (sufficient: with its
    dimensions ordered by stride, each stride steps past all the smaller ones span)."""
    span = 1  # elements the dimensions so far reach, plus one
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride < span:
            return False
        span += (size - 1) * stride
    return True


def check_disjoint(tensors: Sequence[torch.Tensor], what: str) -> None:
    """Raise `InvalidInputError` if any two elements of `tensors` share memory (within one
    tensor or across them): the store writes each block's bytes to exactly one place, and
    would otherwise return (and cache) another block's bytes under this block's key."""
    if len(tensors) == 1 and _spread(tensors[0]):
        return  # one tensor laid out without overlap (a contiguous one, or block rows of it)
    by_device: dict[torch.device, list[np.ndarray]] = {}
    spans: dict[torch.device, list[tuple[int, int]]] = {}  # contiguous tensors: one run each
    for t in tensors:
        if t.numel() == 0:
            continue
        if t.is_contiguous():
            start = t.data_ptr()
            spans.setdefault(t.device, []).append((start, start + t.numel() * t.element_size()))
            continue
        if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
            raise InvalidInputError(f"{what}: a tensor has expanded (stride-0) dimensions; its elements alias")
        runs = _runs(t)
        if runs is None:  # too fragmented to list: torch's own check, then refuse if unsure
            if torch._debug_has_internal_overlap(t) != 0 or len(tensors) > 1:
                raise InvalidInputError(f"{what}: cannot prove the destination tensors disjoint")
            continue
        by_device.setdefault(t.device, []).append(runs)
    for device, listed in spans.items():
        by_device.setdefault(device, []).append(np.array(listed, dtype=np.int64))
    for groups in by_device.values():
        runs = np.concatenate(groups)
        runs = runs[np.argsort(runs[:, 0], kind="stable")]
        if len(runs) > 1 and bool(np.any(runs[1:, 0] < runs[:-1, 1])):
            raise InvalidInputError(f"{what} overlap in memory: each block needs a buffer of its own")


def check_kv(config: StoreConfig, kv: object, num_tokens: int) -> torch.Tensor:
    """`kv` as `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` of the layout's dtype
    (detached: a tensor that requires grad must not drag tier memory into its graph)."""
    layout = config.layout
    expected = (
        f"[num_layers={layout.num_layers}, 2, num_tokens={num_tokens}, "
        f"num_kv_heads={layout.num_kv_heads}, head_dim={layout.head_dim}]"
    )
    if not isinstance(kv, torch.Tensor):
        raise LayoutMismatchError(f"kv must be a torch.Tensor {expected}, got {type(kv).__name__}")
    check_usable(kv, "kv")
    if kv.dim() != 5:
        raise LayoutMismatchError(f"kv has shape {tuple(kv.shape)}; the layout expects {expected}")
    num_layers, two, n, heads, dim = kv.shape
    if (num_layers, two, heads, dim) != (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim):
        raise LayoutMismatchError(f"kv has shape {tuple(kv.shape)}; the layout expects {expected}")
    if n != num_tokens:
        raise LayoutMismatchError(f"kv holds {n} tokens but {num_tokens} tokens were given")
    if kv.dtype != layout.dtype:
        raise LayoutMismatchError(f"kv dtype is {kv.dtype}; the layout expects {layout.dtype}")
    return kv.detach()


_DEVICES: set[torch.device] = set()  # devices a tensor was made on


def check_device(device: object) -> torch.device:
    """`device` as a torch.device that can hold tensors; InvalidInputError otherwise."""
    if device is None:
        return torch.device("cpu")
    try:
        dev: torch.device = torch.device(device)  # type: ignore[call-overload]  # validated here: any object
        if dev.type == "meta":
            raise RuntimeError("meta tensors hold no data")
        if dev not in _DEVICES:
            torch.empty(0, device=dev)
            _DEVICES.add(dev)
    except (RuntimeError, TypeError, AssertionError, ValueError) as exc:
        raise InvalidInputError(f"device {device!r} cannot hold the retrieved KV: {exc}") from None
    return dev


def check_block_tensors(config: StoreConfig, blocks: object, count: int, *, destination: bool = False) -> None:
    """`count` block-shaped tensors of the layout's dtype (a `BlockBatch` is checked as its
    one tensor of rows); destinations must also be writable and pairwise disjoint."""
    if isinstance(blocks, (torch.Tensor, str, bytes)) or not isinstance(blocks, Sequence):
        raise InvalidInputError(f"blocks must be a sequence of tensors, got {type(blocks).__name__}")
    if len(blocks) != count:
        raise InvalidInputError(f"{count} block keys but {len(blocks)} block tensors: one tensor per key")
    if isinstance(blocks, BlockBatch):
        _check_batch(config, blocks, destination)
        return
    for i, block in enumerate(blocks):
        _check_block(config, block, f"block {i}", config.block_shape)
        if destination:
            check_writable(block, f"destination block {i}")
    if destination:
        check_disjoint([b for b in blocks if isinstance(b, torch.Tensor)], "destination blocks")


def _check_block(config: StoreConfig, block: object, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    check_usable(block, what)
    assert isinstance(block, torch.Tensor)
    if tuple(block.shape) != shape:
        raise LayoutMismatchError(f"a block must be a tensor {config.block_shape}, got {tuple(block.shape)}")
    if block.dtype != config.layout.dtype:
        raise LayoutMismatchError(f"block dtype is {block.dtype}; the layout expects {config.layout.dtype}")
    return block


def _check_batch(config: StoreConfig, batch: BlockBatch, destination: bool) -> None:
    rows = batch.rows
    num_rows = rows.shape[0] if isinstance(rows, torch.Tensor) and rows.dim() else 0
    _check_block(config, rows, "blocks", (num_rows, *config.block_shape))
    ids = batch.row_ids
    inside = (not ids or (min(ids) >= 0 and max(ids) < num_rows) if isinstance(ids, range)
              else all(isinstance(r, int) and 0 <= r < num_rows for r in ids))
    if not inside:
        raise InvalidInputError(f"a BlockBatch names rows outside its {num_rows}")
    if destination:
        check_writable(rows, "destination blocks")
        if not isinstance(ids, range) and len(set(ids)) != len(ids):
            raise InvalidInputError("destination blocks overlap in memory: each block needs a buffer of its own")
        check_disjoint([rows], "destination blocks")
