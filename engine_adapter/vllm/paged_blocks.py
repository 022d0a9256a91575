"""Whole-block byte copies between an engine's paged per-layer KV tensors and kvstrata blocks.

The engine's block contents are opaque here: whatever a layer tensor holds for one block
(K and V, any head/token packing, any dtype) is copied as bytes, in the layer view's logical
element order. A kvstrata block is those bytes for every layer, in layer order, shaped as
the uint8 layout `[num_layers, 2, block_size, 1, slot // (2 * block_size)]`, where a layer's
slot is its bytes rounded up to a multiple of `2 * block_size` (a recurrent state's size need
not divide by the block's tokens); the rounding bytes are zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.config import KVLayout
from kvstore.errors import ConfigError, LayoutMismatchError


def opaque_layout(num_layers: int, layer_block_bytes: int, block_size: int) -> KVLayout:
    """The uint8 `KVLayout` whose block holds `layer_block_bytes` per layer (each layer's
    slot rounded up to a multiple of `2 * block_size` bytes)."""
    if layer_block_bytes < 1:
        raise ConfigError(f"a layer's block must hold at least one byte, got {layer_block_bytes}")
    return KVLayout(num_layers, 1, -(-layer_block_bytes // (2 * block_size)), torch.uint8)


class PagedKVBlocks:
    """Copies engine blocks (ids into dim 0 of every layer tensor) to and from kvstrata blocks.

    Dim 0 of each layer tensor indexes kernel blocks; an engine block is `kernel_per_block`
    consecutive kernel blocks (1 unless the attention kernel splits blocks). Holds views of
    the engine's tensors; copies change only the blocks named.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, block_size: int) -> None:
        if not layers:
            raise ConfigError("no KV cache layers to register")
        first = layers[0]
        if first.shape[0] % num_blocks:
            raise ConfigError(
                f"layer tensor dim 0 ({first.shape[0]}) is not a multiple of the engine's "
                f"{num_blocks} blocks; unsupported KV cache layout {tuple(first.shape)}"
            )
        self.kernel_per_block = first.shape[0] // num_blocks
        self.num_blocks = num_blocks
        self._views: list[torch.Tensor] = []
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError("KV cache layers differ in shape, dtype or device")
            if t.stride(-1) != 1:
                raise ConfigError(f"KV cache layer's last dim is strided {t.stride()}")
            self._views.append(t.view(torch.uint8))
        kernel_bytes = self._views[0][0].numel()
        self.layer_block_bytes = kernel_bytes * self.kernel_per_block
        self.layout = opaque_layout(len(layers), self.layer_block_bytes, block_size)
        self.block_shape = self.layout.block_shape(block_size)
        self._padded = self.layout.block_bytes(block_size) != len(layers) * self.layer_block_bytes
        self.device = first.device

    def _kernel_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise LayoutMismatchError(f"block ids out of range [0, {self.num_blocks})")
        r = self.kernel_per_block
        if r != 1:
            ids = (ids[:, None] * r + torch.arange(r)).flatten()
        return ids.to(self.device)

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A host buffer of `num_blocks` kvstrata blocks: `[num_blocks, *block_shape]` uint8
        (zeroed where layer slots are rounded up, so those bytes are always zeros)."""
        make = torch.zeros if self._padded else torch.empty
        return make((num_blocks, *self.block_shape), dtype=torch.uint8)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy engine blocks `block_ids` into `out[:len(block_ids)]` (a `staging` buffer)."""
        n = len(block_ids)
        if n == 0:
            return
        kidx = self._kernel_ids(block_ids)
        flat = out.view(out.shape[0], len(self._views), -1)[:, :, : self.layer_block_bytes]
        for layer, view in enumerate(self._views):
            if view.device.type == "cpu":  # numpy: one thread (see tiers/shared/blockcopy.py)
                rows = np.take(view.numpy(), kidx.numpy(), axis=0)
                flat.numpy()[:n, layer, :] = rows.reshape(n, -1)
            else:
                flat[:n, layer].copy_(view.index_select(0, kidx).reshape(n, -1))

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy `src[:len(block_ids)]` (a `staging` buffer) into engine blocks `block_ids`."""
        n = len(block_ids)
        if n == 0:
            return
        kidx = self._kernel_ids(block_ids)
        flat = src.view(src.shape[0], len(self._views), -1)[:, :, : self.layer_block_bytes]
        for layer, view in enumerate(self._views):
            rows = flat[:n, layer].reshape(kidx.numel(), *view.shape[1:])
            if view.device.type == "cpu":
                view.numpy()[kidx.numpy()] = rows.numpy()
            else:
                view.index_copy_(0, kidx, rows.to(view.device))
