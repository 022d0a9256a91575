"""Per-tenant quotas: a flood from one cache salt leaves another's quota of blocks cached,
in the CPU tier and in the trace replay; per-tenant counters under hashed labels."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from bench.trace import DEFAULT_TRACE
from bench.trace_policy import Trace
from bench.trace_quota import run_quota
from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError
from kvstore.hashing import BlockHash
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.cpu.tier import CPUTier
from tiers.keys import BlockKey
from tiers.policies.eviction import EvictionKind
from tiers.policies.quota import tenant_label

SHAPE = LAYOUT.block_shape(BLOCK)


def tenant_key(i: int, tenant: bytes, parent: int | None = None) -> BlockKey:
    """Block `i`'s key as the store builds it for a tenant (and, optionally, a parent)."""
    return BlockKey(BlockHash(i.to_bytes(16, "little")), i.to_bytes(4, "little") * BLOCK,
                    None if parent is None else BlockHash(parent.to_bytes(16, "little")), None, tenant)


def store(tier: CPUTier, ids: list[int], tenant: bytes) -> None:
    keys = [tenant_key(i, tenant) for i in ids]
    tier.put(keys, [torch.full(SHAPE, float(i % 50), dtype=LAYOUT.dtype) for i in ids])


def held(tier: CPUTier, ids: range) -> int:
    return sum(tier.match_prefix([BlockHash(i.to_bytes(16, "little"))]) for i in ids)


def read(tier: CPUTier, ids: list[int], tenant: bytes) -> int:
    dsts = [torch.empty(SHAPE, dtype=LAYOUT.dtype) for _ in ids]
    return tier.get_into([tenant_key(i, tenant) for i in ids], dsts)


@pytest.mark.parametrize("kind", list(EvictionKind))
def test_a_flood_from_one_salt_leaves_the_others_quota_cached(kind: EvictionKind) -> None:
    """B writes 200 one-off blocks into a tier of 20 while A keeps using its 8 (within its
    quota of 10): every one of A's blocks stays, B recycles its own."""
    tier = CPUTier(20, SHAPE, LAYOUT.dtype, eviction=kind, tenant_quota_blocks=10)
    store(tier, list(range(8)), b"salt-a")  # A's working set, within its quota
    for start in range(1000, 1200, 5):  # B writes 200 one-off blocks, five at a time
        store(tier, list(range(start, start + 5)), b"salt-b")
        if start % 15 == 0:
            assert read(tier, list(range(8)), b"salt-a") == 8  # A uses its working set
        tier.check_integrity()
    assert held(tier, range(8)) == 8
    stats = {s.label: s for s in tier.tenant_stats()}
    a, b = stats[tenant_label(b"salt-a")], stats[tenant_label(b"salt-b")]
    assert (a.num_blocks, a.num_evictions) == (8, 0)
    assert b.num_blocks == 12 and b.num_evictions == 188 and b.num_puts == 200 and b.quota_blocks == 10
    tier.close()


def test_without_quotas_the_flood_takes_everything() -> None:
    tier = CPUTier(20, SHAPE, LAYOUT.dtype, eviction=EvictionKind.LRU)
    store(tier, list(range(8)), b"salt-a")
    for start in range(1000, 1200, 5):
        store(tier, list(range(start, start + 5)), b"salt-b")
        if start % 15 == 0 and read(tier, list(range(8)), b"salt-a") < 8:
            break
    assert held(tier, range(8)) < 8 and tier.tenant_stats() == []
    tier.close()


def test_an_idle_tenant_stops_reserving_its_share() -> None:
    """A tenant that neither adds nor hits a block while a tier's worth of blocks is added
    gives its blocks up to the others before they evict their own."""
    tier = CPUTier(20, SHAPE, LAYOUT.dtype, tenant_quota_blocks=10)
    store(tier, list(range(8)), b"salt-a")
    for start in range(1000, 1025, 5):  # B adds 25 blocks: A idle for more than a turnover
        store(tier, list(range(start, start + 5)), b"salt-b")
    assert held(tier, range(8)) == 8  # B recycled its own while A was not idle yet
    store(tier, list(range(2000, 2005)), b"salt-b")
    assert held(tier, range(8)) == 3 and held(tier, range(2000, 2005)) == 5
    stats = {s.label: s.num_blocks for s in tier.tenant_stats()}
    assert stats == {tenant_label(b"salt-a"): 3, tenant_label(b"salt-b"): 17}
    tier.check_integrity()
    tier.close()


def test_a_tenant_over_its_quota_evicts_its_own_blocks_first() -> None:
    tier = CPUTier(20, SHAPE, LAYOUT.dtype, tenant_quota_blocks=10)
    store(tier, list(range(12)), b"big")  # 12 > 10: over quota while the tier has room
    store(tier, list(range(100, 108)), b"small")  # fills the tier: 20 blocks
    store(tier, list(range(200, 202)), b"small")  # small stays within quota; big, over it, gives up 2
    assert held(tier, range(100, 108)) == 8 and held(tier, range(200, 202)) == 2
    assert held(tier, range(12)) == 10
    store(tier, list(range(300, 305)), b"big")  # big at 10 + 5 > 10: it evicts its own
    assert held(tier, range(100, 108)) == 8 and held(tier, range(200, 202)) == 2
    assert held(tier, range(12)) + held(tier, range(300, 305)) == 10
    store(tier, list(range(400, 403)), b"small")  # small at 10 + 3 > 10: three of its own go
    assert held(tier, range(100, 108)) + held(tier, range(200, 202)) + held(tier, range(400, 403)) == 10
    tier.check_integrity()
    tier.close()


def test_hits_and_labels_per_tenant() -> None:
    tier = CPUTier(8, SHAPE, LAYOUT.dtype, tenant_quota_blocks=4)
    store(tier, [0, 1], b"secret-salt")
    dsts = [torch.empty(SHAPE, dtype=LAYOUT.dtype) for _ in range(2)]
    assert tier.get_into([tenant_key(0, b"secret-salt"), tenant_key(1, b"secret-salt")], dsts) == 2
    (stats,) = tier.tenant_stats()
    assert stats.num_hits == 2 and len(stats.label) == 16 and "secret" not in stats.label
    assert tenant_label(b"") == "default"
    tier.close()


def test_store_config_quota(tmp_path: object) -> None:
    block_bytes = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=16 * block_bytes, cpu_tenant_quota_bytes=4 * block_bytes)
    with KVCacheStore(cfg) as s:
        s.store(list(range(8 * BLOCK)), make_kv(8 * BLOCK))
        cpu = s.tiers[0]
        assert isinstance(cpu, CPUTier)
        (stats,) = cpu.tenant_stats()  # keys carry no tenant yet: one default tenant, over quota
        assert stats.label == "default" and stats.num_blocks == 8 and stats.quota_blocks == 4
        s.check_integrity()
    with pytest.raises(ConfigError, match=r"StoreConfig\.cpu_tenant_quota_bytes=10 holds no block"):
        StoreConfig(LAYOUT, block_size=BLOCK, cpu_tenant_quota_bytes=10)


def test_replayed_flood_keeps_the_other_tenants_hits() -> None:
    trace = Trace.load(DEFAULT_TRACE, limit=3000)
    out = run_quota(trace, Fraction(1, 4), "lru", flood_x=3, seed=0)
    runs = out["runs"]
    alone, free, quota = runs["alone"], runs["flood_no_quota"], runs["flood_quota_half"]
    assert free["a_hit_ratio_during_flood"] < 0.5 * alone["a_hit_ratio_during_flood"]
    assert quota["a_hit_ratio_during_flood"] > 2 * free["a_hit_ratio_during_flood"]
    assert quota["b_blocks_at_flood_end"] <= out["quota_blocks"] + 1 < free["b_blocks_at_flood_end"]
    assert run_quota(trace, Fraction(1, 4), "lru", flood_x=3, seed=0) == out  # deterministic
