"""Leaks: anonymous memory stays flat over a long store/retrieve loop, `close()` releases the CPU
slab (pinned on CUDA machines), and reopening a store many times grows neither file
descriptors nor memory mappings."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVLayout
from tests.conftest import POOL_DEVICE
from tiers.cpu.tier import CPUTier
from tiers.disk import env as lmdb_env

from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, PromptPool, check_kv, make_kv, open_store


def _rss_anon_bytes() -> int:
    """Anonymous resident memory (heap, slabs); LMDB's file-backed map pages are not in it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _num_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _mapping_of(addr: int) -> tuple[int, int] | None:
    """The (start, end) of the memory mapping holding `addr`, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                return start, end
    return None


def _loop(store, pool: PromptPool, rng: np.random.Generator, n: int,  # type: ignore[no-untyped-def]
          layout: KVLayout = LAYOUT) -> int:
    blocks = 0
    for _ in range(n):
        tokens = pool.prompt(int(rng.integers(pool.num_prompts)))
        if rng.random() < 0.5:
            store.store(tokens, make_kv(tokens, layout, BLOCK))
        else:
            res = store.retrieve(tokens)
            blocks += check_kv(tokens, res.kv, res.num_tokens, layout, BLOCK)
    return blocks


# 32 KiB blocks: a 40 MiB slab (above glibc's largest mmap threshold, so a freed slab goes
# straight back to the OS) fills within a few hundred operations.
MID = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)


@pytest.mark.slow
def test_memory_flat_and_released_on_close(tmp_path: Path, figures: Figures) -> None:
    slab_bytes = 1280 * MID.block_bytes(BLOCK)
    store = open_store(str(tmp_path), layout=MID, cpu_bytes=slab_bytes, disk_bytes=16 << 20)
    try:
        pool = PromptPool(BUDGET.seed, 4096, num_roots=32)
        rng = np.random.default_rng([BUDGET.seed, 60])
        cpu = store.tiers[0]
        assert isinstance(cpu, CPUTier)
        slab = weakref.ref(cpu.slab)
        pinned = cpu.is_pinned_memory
        slab_map = _mapping_of(cpu.slab.data_ptr())
        assert slab_map is not None and slab_map[1] - slab_map[0] >= slab_bytes
        # Warm up until every slot has been written (its pages resident) and the disk tier
        # evicts: from then on nothing is allowed to grow.
        for _ in range(50):
            if len(cpu) == cpu.capacity_blocks:
                break
            _loop(store, pool, rng, 200, MID)
        assert len(cpu) == cpu.capacity_blocks
        _loop(store, pool, rng, 200, MID)
        gc.collect()
        before = _rss_anon_bytes()
        blocks = _loop(store, pool, rng, BUDGET.leak_iterations, MID)
        gc.collect()
        after = _rss_anon_bytes()
        growth = after - before
        assert growth < 16 << 20, f"anonymous RSS grew {growth >> 20} MiB over the loop"
        store.check_integrity()
    finally:
        store.close()
    gc.collect()
    assert slab() is None, "close() left the CPU slab alive"
    # The slab's own mapping is gone: its memory went back to the OS, not to a free list. A
    # pinned slab (CUDA present) goes back to CUDA's host allocator instead: see
    # test_pinned_memory_released_on_close.
    if not pinned:
        assert _mapping_of(slab_map[0]) != slab_map, "close() left the CPU slab mapped"
    released = after - _rss_anon_bytes()
    figures.set("iterations", BUDGET.leak_iterations)
    figures.set("blocks_verified", blocks)
    figures.set("rss_anon_growth_kib", growth >> 10)
    figures.set("rss_anon_released_on_close_kib", released >> 10)


@pytest.mark.slow
def test_reopen_many_times_keeps_fds_and_maps_flat(tmp_path: Path, figures: Figures) -> None:
    pool = PromptPool(BUDGET.seed, 64, num_roots=4)
    rng = np.random.default_rng([BUDGET.seed, 61])

    def cycle() -> None:
        with open_store(str(tmp_path), cpu_bytes=32 * LAYOUT.block_bytes(BLOCK)) as store:
            _loop(store, pool, rng, 4)

    for _ in range(3):
        cycle()
    gc.collect()
    fds, maps = _num_fds(), _num_maps()
    for _ in range(BUDGET.reopen_cycles):
        cycle()
    gc.collect()
    assert _num_fds() - fds <= 0, f"file descriptors grew from {fds} to {_num_fds()}"
    assert _num_maps() - maps <= 2, f"memory mappings grew from {maps} to {_num_maps()}"
    assert not lmdb_env._ENVS, "an LMDB environment outlived every store using it"
    figures.set("reopen_cycles", BUDGET.reopen_cycles)
    figures.set("fd_growth", _num_fds() - fds)
    figures.set("map_growth", _num_maps() - maps)


def _host_allocated_bytes(stats: dict[str, int]) -> int:
    """Pinned bytes allocated now, under the key this torch version uses (0 before any)."""
    for key in ("allocated_bytes.all.current", "allocated_bytes.current"):
        if key in stats:
            return stats[key]
    if not stats:
        return 0
    raise AssertionError(f"no allocated-bytes key in torch.cuda.memory.host_memory_stats(): {sorted(stats)}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_memory_released_on_close(tmp_path: Path, figures: Figures) -> None:
    """Closing a store hands its pinned slab back: the slab object dies, and opening and
    closing stores again and again does not grow the pinned memory CUDA's host allocator
    holds (a slab kept alive by close() would add its size every cycle)."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    slab_bytes = 4096 * LAYOUT.block_bytes(BLOCK)
    levels = []
    for cycle in range(4):
        store = open_store(str(tmp_path), cpu_bytes=slab_bytes)
        cpu = store.tiers[0]
        assert isinstance(cpu, CPUTier) and cpu.is_pinned_memory
        slab = weakref.ref(cpu.slab)
        pool = PromptPool(BUDGET.seed, 256)
        rng = np.random.default_rng([BUDGET.seed, 62, cycle])
        for _ in range(100):
            tokens = pool.prompt(int(rng.integers(pool.num_prompts)))
            if rng.random() < 0.5:
                store.store(tokens, make_kv(tokens, LAYOUT, BLOCK).cuda())
            else:
                res = store.retrieve(tokens, device="cuda")
                if res.kv is not None:
                    check_kv(tokens, res.kv.cpu(), res.num_tokens, LAYOUT, BLOCK)
        store.close()
        del cpu
        gc.collect()
        torch.cuda.synchronize()
        assert slab() is None, "close() left the pinned slab alive"
        if stats is not None:
            levels.append(_host_allocated_bytes(stats()))
    if levels:
        assert levels[-1] <= levels[0], f"pinned bytes held after each close grew: {levels}"
    figures.set("pinned_released", 1)


@pytest.mark.slow
@pytest.mark.parametrize("demotion", ["on_evict", "write_through"])
def test_pool_and_manager_memory_flat_and_released_on_close(tmp_path: Path, demotion: str,
                                                             figures: Figures) -> None:
    """Manager requests (add, allocate, commit, decode, free) interleaved with store/retrieve on
    a pool-fronted store: anonymous RSS flat once every tier is full, no request state left
    behind, and `close()` releases the pool's 40 MiB KV tensor (its mapping gone)."""
    from engine_adapter.runner.block_manager import KVCacheManager

    from .runnerkv import serve

    pool_bytes = 1280 * MID.block_bytes(BLOCK)
    store = open_store(str(tmp_path), layout=MID, pool_blocks=1280, pool_device=POOL_DEVICE,
                       pool_demotion=demotion, cpu_bytes=256 * MID.block_bytes(BLOCK), disk_bytes=16 << 20)
    mgr = KVCacheManager(store)
    prompts = PromptPool(BUDGET.seed, 4096, num_roots=32)
    rng = np.random.default_rng([BUDGET.seed, 63, len(demotion)])
    num_requests = 0

    def loop(n: int) -> int:
        nonlocal num_requests
        blocks = 0
        for k in range(n):
            tokens = prompts.prompt(int(rng.integers(prompts.num_prompts)))
            if k % 2 == 0 and len(tokens):
                got = serve(mgr, f"r{num_requests}", tokens, MID, BLOCK, num_decode=int(rng.integers(3)))
                assert got is not None
                blocks += got[1]
                num_requests += 1
            else:
                blocks += _loop(store, prompts, rng, 1, MID)
        return blocks

    try:
        pool = store.pool
        assert pool is not None
        kv_cache = weakref.ref(pool.kv_cache)
        on_cuda = pool.kv_cache.is_cuda
        pool_map = None if on_cuda else _mapping_of(pool.kv_cache.data_ptr())
        assert on_cuda or (pool_map is not None and pool_map[1] - pool_map[0] >= pool_bytes)
        cuda_before_close = torch.cuda.memory_allocated() if on_cuda else 0
        cpu = store.tiers[1]
        for _ in range(40):  # warm up until the pool evicts and every CPU slot has been written
            if pool.stats().num_evictions and len(cpu) == cpu.capacity_blocks:
                break
            loop(200)
        assert pool.stats().num_evictions and len(cpu) == cpu.capacity_blocks
        loop(100)
        gc.collect()
        before = _rss_anon_bytes()
        blocks = loop(BUDGET.leak_iterations // 3)
        gc.collect()
        after = _rss_anon_bytes()
        growth = after - before
        assert growth < 16 << 20, f"anonymous RSS grew {growth >> 20} MiB over the loop"
        assert not mgr.request_ids() and len(pool.free_queue) == pool.num_blocks
        store.check_integrity()
    finally:
        store.close()
    del pool
    gc.collect()
    assert kv_cache() is None, "close() left the pool's KV tensor alive"
    if on_cuda:  # the caching allocator keeps the segment; the tensor's bytes are no longer allocated
        assert torch.cuda.memory_allocated() <= cuda_before_close - pool_bytes
    else:
        assert pool_map is not None and _mapping_of(pool_map[0]) != pool_map, "close() left the pool's KV tensor mapped"
    figures.set("iterations", BUDGET.leak_iterations // 3)
    figures.set("manager_requests", num_requests)
    figures.set("blocks_verified", blocks)
    figures.set("rss_anon_growth_kib", growth >> 10)
    figures.set("rss_anon_released_on_close_kib", (after - _rss_anon_bytes()) >> 10)
