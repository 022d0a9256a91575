"""Corruption seen through the manager: a lower-tier block that fails validation while
`allocate_slots` loads it into the pool must shorten `num_computed_tokens` to the blocks
before it (the runner recomputes the rest), never hand damaged KV to the runner, and the
damaged copy must be gone. Damage: a flipped payload bit in its slot file, an index entry
naming another prefix's token ids under a valid checksum, flipped bits in CPU slots (`cpu_checksums`), and
a pool block whose token ids differ from the request's (a simulated hash collision)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_adapter.runner.block_manager import KVCacheManager
from kvstore import KVCacheStore
from tests.conftest import POOL_DEVICE
from tiers.cpu.tier import CPUTier
from tiers.disk.tier import LMDBTier

from . import diskdamage
from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, make_kv, open_store
from .runnerkv import serve

NUM_PROMPTS = 12


def _prompts(rng: np.random.Generator) -> list[np.ndarray]:
    # + 1 token: the manager always leaves the last prompt token to compute.
    return [rng.integers(0, 2**32, size=int(rng.integers(2, 6)) * BLOCK + 1, dtype=np.uint32)
            for _ in range(NUM_PROMPTS)]


def _serve_all(store: KVCacheStore, prompts: list[np.ndarray], damaged: dict[int, int]) -> int:
    """Serve every prompt; each must reuse exactly the blocks before its damaged one."""
    mgr = KVCacheManager(store)
    num_blocks = 0
    for i, tokens in enumerate(prompts):
        got = serve(mgr, f"p{i}", tokens, LAYOUT, BLOCK)  # byte-checks every reused block
        assert got is not None
        want = damaged.get(i, len(tokens) // BLOCK) * BLOCK
        assert got[0] == want, f"prompt {i}: reused {got[0]} tokens, expected {want}"
        num_blocks += got[0] // BLOCK
    store.check_integrity()
    return num_blocks


@pytest.mark.parametrize("kind", ["payload-bit", "other-tokens"])
def test_damaged_disk_record_shortens_the_prefix(tmp_path: Path, kind: str, figures: Figures) -> None:
    rng = np.random.default_rng([BUDGET.seed, 24, len(kind)])
    prompts = _prompts(rng)
    with open_store(str(tmp_path), pool_blocks=16, pool_device=POOL_DEVICE) as store:
        for tokens in prompts:
            store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        damaged = {i: int(rng.integers(len(t) // BLOCK)) for i, t in enumerate(prompts) if i % 2 == 0}
    # close() spilled the pool to disk; damage the blocks there, then serve from a cold pool.
    with open_store(str(tmp_path), pool_blocks=16, pool_device=POOL_DEVICE) as store:
        disk = store.tiers[-1]
        assert isinstance(disk, LMDBTier)
        locations = {i: disk.payload_location(store.block_hashes(prompts[i])[index]) for i, index in damaged.items()}
    values = {}
    for loc in locations.values():
        assert loc is not None
        if kind == "payload-bit":
            diskdamage.damage_payload(loc, "payload-bit", rng)
        else:  # a sound entry and checksum, but another prefix's token ids
            tokens = diskdamage.read_entry(tmp_path, loc.index_key).tokens
            values[loc.index_key] = diskdamage.entry_with_tokens(tmp_path, loc, bytes(reversed(tokens)))
    if values:
        diskdamage.put_entries(tmp_path, values)
    with open_store(str(tmp_path), pool_blocks=64, pool_device=POOL_DEVICE) as store:
        num_blocks = _serve_all(store, prompts, damaged)
        disk = store.tiers[-1]
        assert isinstance(disk, LMDBTier)
        for i, index in damaged.items():  # the damaged record is gone
            assert disk.match_prefix([store.block_hashes(prompts[i])[index]]) == 0
        assert disk.stats().num_corrupt == len(damaged)
        assert disk.scrub().num_corrupt == 0
    figures.set("injected", len(damaged))
    figures.set("detected", len(damaged))
    figures.set("blocks_reused_and_verified", num_blocks)


def test_damaged_cpu_slot_shortens_the_prefix(tmp_path: Path, figures: Figures) -> None:
    rng = np.random.default_rng([BUDGET.seed, 25])
    prompts = _prompts(rng)
    # An 8-block pool: storing demotes nearly every block into the checksummed CPU tier.
    store = open_store(None, pool_blocks=8, pool_device=POOL_DEVICE, cpu_checksums=True,
                       cpu_bytes=128 * LAYOUT.block_bytes(BLOCK))
    try:
        for tokens in prompts:
            store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        pool = store.pool
        assert pool is not None
        pool.spill()  # every block to the CPU tier, then out of the pool: every hit loads from CPU
        pool.clear()
        cpu = store.tiers[1]
        assert isinstance(cpu, CPUTier)
        damaged = {}
        for i in range(0, NUM_PROMPTS, 2):
            index = int(rng.integers(len(prompts[i]) // BLOCK))
            view = cpu.block_view(store.block_hashes(prompts[i])[index])
            assert view is not None, "block not in the CPU tier"
            raw = view.view(torch.uint8).view(-1)
            raw[int(rng.integers(raw.numel()))] ^= 1 << int(rng.integers(8))
            damaged[i] = index
        num_blocks = _serve_all(store, prompts, damaged)
        assert cpu.stats().num_corrupt == len(damaged)
        figures.set("injected", len(damaged))
        figures.set("detected", cpu.stats().num_corrupt)
        figures.set("blocks_reused_and_verified", num_blocks)
    finally:
        store.close()


def test_pool_block_with_other_tokens_is_a_miss(figures: Figures) -> None:
    """A pool block cached under the request's hash but holding other token ids (what a hash
    collision looks like): the manager must not reuse it or anything after it."""
    rng = np.random.default_rng([BUDGET.seed, 26])
    prompts = _prompts(rng)
    store = open_store(None, pool_blocks=64, pool_device=POOL_DEVICE, cpu_bytes=0)
    try:
        for tokens in prompts:
            store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        pool = store.pool
        assert pool is not None
        damaged = {}
        for i in range(0, NUM_PROMPTS, 2):
            index = int(rng.integers(len(prompts[i]) // BLOCK))
            block = pool.cached[store.block_hashes(prompts[i])[index]]
            block.tokens = bytes(reversed(block.tokens))
            damaged[i] = index
        num_blocks = _serve_all(store, prompts, damaged)
        figures.set("injected", len(damaged))
        figures.set("detected", len(damaged))
        figures.set("blocks_reused_and_verified", num_blocks)
    finally:
        store.close()
