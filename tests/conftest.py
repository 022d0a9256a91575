"""Shared fixtures: small layouts, deterministic KV, store factories over real LMDB dirs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore import KVCacheStore, KVLayout, StoreConfig
from tests.switches import switches

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
BLOCK = 4
# Device of the block pool in tests that have one (and of the runner's model): "cpu" by
# default; `KVSTRATA_TEST_POOL_DEVICE=cuda` runs them with the pool on the GPU (pinned CPU
# slab, side-stream demotion).
POOL_DEVICE = switches().pool_device


def make_kv(num_tokens: int, seed: int = 0, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """Random KV `[L, 2, num_tokens, H, D]` of the layout's dtype, reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    shape = layout.block_shape(num_tokens)
    if layout.dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(layout.dtype)
    return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).view(layout.dtype)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., KVCacheStore]]:
    """Factory of stores over `tmp_path/disk`; every store it made is closed afterwards."""
    made: list[KVCacheStore] = []

    def factory(*, cpu_blocks: int = 64, disk: bool = True, **overrides: object) -> KVCacheStore:
        kwargs: dict[str, object] = {
            "layout": LAYOUT,
            "block_size": BLOCK,
            "cpu_bytes": cpu_blocks * LAYOUT.block_bytes(BLOCK),
            "disk_path": str(tmp_path / "disk") if disk else None,
            "disk_bytes": 64 << 20,
            "disk_sync": False,
        }
        kwargs.update(overrides)
        store = KVCacheStore(StoreConfig(**kwargs))  # type: ignore[arg-type]
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()
