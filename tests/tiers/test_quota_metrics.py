"""The per-tenant metric series stay bounded however many cache salts come and go."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import KVCacheStore, StoreConfig
from kvstore.hashing import ExtraKeys
from kvstore.metrics import register_metrics
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.policies.eviction import EvictionKind
from tiers.policies.quota import OTHER_LABEL

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TENANT_FAMILIES = 5  # kvstrata_tenant_{blocks,quota_blocks,hits,blocks_stored,blocks_evicted}


def tenant_samples(registry: object) -> dict[tuple[str, str], float]:
    """(metric, tenant label) -> value of every kvstrata_tenant_* sample in a scrape."""
    text = prometheus_client.generate_latest(registry).decode()
    return {(s.name, s.labels["tenant"]): s.value for family in text_string_to_metric_families(text)
            if family.name.startswith("kvstrata_tenant_") for s in family.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("kind", list(EvictionKind))
def test_tenant_series_stay_bounded_as_salts_come_and_go(tmp_path: Path, kind: EvictionKind) -> None:
    """600 salts store 2 blocks each through a 16-block CPU tier with quotas (demoting with
    `seen:2` admission to disk): the scrape holds series for the tenants holding blocks and
    `other` only, and the blocks counted stored over all series are every block stored."""
    registry = prometheus_client.CollectorRegistry()
    block_bytes = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, namespace="salts", cpu_bytes=16 * block_bytes,
                      cpu_tenant_quota_bytes=4 * block_bytes, cpu_eviction=kind, demote_admission="seen:2",
                      disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, disk_sync=False)
    kv = make_kv(2 * BLOCK)
    with KVCacheStore(cfg) as store:
        register_metrics(store, registry)
        for s in range(600):
            tokens = list(range(s * 2 * BLOCK, (s + 1) * 2 * BLOCK))
            store.store(tokens, kv, extra_keys=ExtraKeys(cache_salt=f"salt-{s}"))
            if s % 100 == 99:
                samples = tenant_samples(registry)
                labels = {label for _, label in samples}
                assert len(samples) <= TENANT_FAMILIES * (16 + 1), len(samples)
                assert OTHER_LABEL in labels and len(labels) <= 16 + 1
        samples = tenant_samples(registry)
        assert sum(v for (name, _), v in samples.items() if name == "kvstrata_tenant_blocks_stored_total") == 1200
        assert sum(v for (name, _), v in samples.items() if name == "kvstrata_tenant_blocks") == 16
        store.check_integrity()
