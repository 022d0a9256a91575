"""CUDA-only checks: the pool on the GPU, pinned CPU slabs, side-stream demotion.

Marked `gpu`: skipped cleanly on machines without CUDA (see conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_adapter.runner.block_manager import KVCacheManager
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.cpu.tier import CPUTier
from tiers.keys import TierKind

pytestmark = pytest.mark.gpu
LAYOUT = KVLayout(4, 8, 128, torch.bfloat16)


def test_cpu_slab_is_pinned_with_cuda() -> None:
    cpu = CPUTier(4, LAYOUT.block_shape(16), LAYOUT.dtype)
    assert cpu.is_pinned_memory
    cpu.close()


def test_pool_on_cuda_round_trip_through_every_tier(tmp_path: Path) -> None:
    cfg = StoreConfig(LAYOUT, block_size=16, pool_blocks=8, pool_device="cuda", cpu_bytes=8 * LAYOUT.block_bytes(16),
                      disk_path=str(tmp_path / "d"), disk_bytes=256 << 20, disk_sync=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    docs = [[d * 10_000 + i for i in range(128)] for d in range(3)]
    kvs = [torch.randn(LAYOUT.block_shape(128), device="cuda", generator=g).to(LAYOUT.dtype) for _ in docs]
    with KVCacheStore(cfg) as store:
        assert store.pool is not None and store.pool.kv_cache.is_cuda
        for t, kv in zip(docs, kvs):
            assert store.store(t, kv) == 128
        seen = set()
        for t, kv in reversed(list(zip(docs, kvs))):
            res = store.retrieve(t, device="cuda")
            assert res.kv.is_cuda and torch.equal(res.kv.view(torch.int16), kv.view(torch.int16))
            seen |= set(res.blocks_per_tier)
            store.check_integrity()
        assert seen == {TierKind.POOL, TierKind.CPU, TierKind.DISK}


@pytest.mark.parametrize("policy", ["on_evict", "write_through"])
def test_side_stream_demotion_is_bit_exact_under_concurrent_compute(policy: str) -> None:
    """Compute keeps writing other blocks on the default stream while evicted blocks are copied."""
    cfg = StoreConfig(LAYOUT, block_size=16, pool_blocks=4, pool_device="cuda", pool_demotion=policy,
                      cpu_bytes=64 * LAYOUT.block_bytes(16))
    with KVCacheStore(cfg) as store:
        mgr = KVCacheManager(store)
        pool = store.pool
        assert pool is not None
        expected = {}
        for i in range(12):
            rid = f"r{i}"
            toks = [i * 1000 + j for j in range(64)]
            mgr.add_request(rid, toks)
            mgr.allocate_slots(rid, 64, mgr.get_computed_blocks(rid))
            for k, b in enumerate(mgr.block_table(rid)):
                pool.block_view(b).fill_(float(i * 10 + k))  # "compute" on the default stream
            mgr.commit(rid, 64)
            expected[tuple(toks)] = i
            mgr.free(rid)
        for toks, i in expected.items():
            res = store.retrieve(list(toks), device="cuda")
            if res.num_tokens:
                for k in range(res.num_tokens // 16):
                    assert torch.all(res.kv[:, :, k * 16 : (k + 1) * 16] == float(i * 10 + k))
        assert pool.num_demoted > 0
        store.check_integrity()
