"""Prometheus metrics of a store: per-tier families with tier labels, latency histograms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore import KVCacheStore, StoreConfig
from kvstore.metrics import register_metrics
from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv

prometheus_client = pytest.importorskip("prometheus_client")


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_metrics_follow_the_store_with_tier_labels(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, namespace="metrics", pool_blocks=4, pool_device="cpu",
                      cpu_bytes=4 * LAYOUT.block_bytes(BLOCK), disk_path=str(tmp_path / "d"),
                      disk_bytes=16 << 20, disk_sync=False)
    with KVCacheStore(cfg) as store:
        register_metrics(store, registry)
        tokens = np.arange(12 * BLOCK, dtype=np.uint32)
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))  # 12 blocks: pool 4, the rest demoted down
        store.retrieve(tokens)
        store.lookup(tokens)
        other = np.arange(10_000, 10_000 + 4 * BLOCK, dtype=np.uint32)
        store.store(other, make_kv(other, LAYOUT, BLOCK))  # takes the pool: its blocks are evicted down
        text = prometheus_client.generate_latest(registry).decode()
        ns = bytes(store.seed).hex()[:8]
        for tier in ("pool", "cpu", "disk"):
            assert _value(text, "kvstrata_capacity_bytes", tier=tier, namespace=ns) > 0
        served = sum(_value(text, "kvstrata_hit_tokens_total", tier=t) for t in ("pool", "cpu", "disk"))
        assert served == _value(text, "kvstrata_hit_tokens_all_total") == 12 * BLOCK
        assert _value(text, "kvstrata_blocks_evicted_total", tier="pool") > 0
        assert _value(text, "kvstrata_lookups_total") == 1
        assert _value(text, "kvstrata_blocks_stored_total", tier="disk") > 0
        assert _value(text, "kvstrata_latency_seconds_count", op="store") == 2
        assert _value(text, "kvstrata_latency_seconds_count", op="retrieve") == 1
