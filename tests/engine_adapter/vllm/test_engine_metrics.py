"""The connector's counters as vLLM's connector stats, and its hits by vLLM source (vLLM's
classes, no engine)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.switches import need_vllm

need_vllm()  # engine_metrics imports vLLM: check before importing it
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from engine_adapter.vllm.engine_metrics import (  # noqa: E402
    COUNTERS,
    TIERED,
    KVStrataPromMetrics,
    KVStrataStats,
    hit_sources,
    tier_labels,
)
from engine_adapter.vllm.stats import ConnectorStats  # noqa: E402
from tiers.base import Tier, TierTraits  # noqa: E402
from tiers.keys import TierKind  # noqa: E402
from tiers.tier_config import TierConfig, TierContext, register_tier  # noqa: E402

pytestmark = pytest.mark.vllm


def test_each_report_carries_what_grew_since_the_last() -> None:
    stats = ConnectorStats("worker", None)
    stats.count("load_tokens_cpu", 64)
    stats.set("policy_probes", 2)  # kept elsewhere, set as a total
    assert stats.take_deltas() == {"load_tokens_cpu": 64, "policy_probes": 2}
    assert stats.take_deltas() == {}
    stats.count("load_tokens_cpu", 32)
    stats.set("policy_probes", 3)
    assert stats.take_deltas() == {"load_tokens_cpu": 32, "policy_probes": 1}
    assert stats.counters == {"load_tokens_cpu": 96, "policy_probes": 3}  # the JSON file's totals


def test_worker_and_scheduler_reports_add_up() -> None:
    worker = KVStrataStats(data={"load_tokens_disk": 256, "save_blocks": 2})
    total = worker.aggregate(KVStrataStats(data={"hit_tokens": 256, "save_blocks": 1}))
    assert total.reduce() == {"load_tokens_disk": 256, "save_blocks": 3, "hit_tokens": 256}
    assert not total.is_empty() and KVStrataStats().is_empty()
    total.reset()
    assert total.is_empty()


def test_every_counter_the_connector_keeps_has_a_series() -> None:
    known = set(COUNTERS) | {f"{family}_{tier}" for family in TIERED for tier in tier_labels()}
    for name in ("lookups", "hit_tokens", "hit_requests", "load_tokens_cpu", "load_tokens_disk",
                 "load_tokens_remote", "prefetch_tokens_disk", "save_new_blocks", "prefill_samples",
                 "policy_skipped_blocks", "policy_probes"):
        assert name in known


def test_hits_are_split_by_the_tier_of_each_block() -> None:
    cpu, disk, remote = TierKind.CPU, TierKind.DISK, TierKind.REMOTE
    assert hit_sources([cpu, cpu, disk], 96, 32) == {CacheHitSource.HOST: 64, CacheHitSource.DISK: 32}
    assert hit_sources([disk, remote], 40, 32) == {CacheHitSource.DISK: 32, CacheHitSource.EXTERNAL_UNSPECIFIED: 8}
    assert hit_sources([cpu], 64, 32) == {}  # the tiers do not cover the hit: vLLM's fallback
    assert hit_sources([], 0, 32) == {}


class LateTier(Tier):
    """A tier registered after the connector's metrics module was imported (as one loaded from
    its `module_path` when a config names it); never opened here."""

    kind = TierKind("late_shelf")
    traits = TierTraits(persistent=True)


@dataclass(frozen=True)
class LateTierConfig(TierConfig):
    tier = LateTier

    def open(self, ctx: TierContext) -> Tier:
        raise AssertionError("never opened")


def test_a_tier_registered_later_has_a_source_and_a_series() -> None:
    """Sources and `tier` labels come from the traits of the tiers registered when they are
    used, not from those registered when the module was imported."""
    kind = LateTier.kind
    assert hit_sources([kind], 32, 32) == {}  # not registered: vLLM's fallback, never a KeyError
    register_tier("late_shelf")(LateTierConfig)
    assert hit_sources([TierKind.CPU, kind], 64, 32) == {CacheHitSource.HOST: 32, CacheHitSource.DISK: 32}
    assert "late_shelf" in tier_labels()
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = KVStrataPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name"],  # type: ignore[arg-type]
                                  {0: ["m"]})
    metrics.observe({"load_tokens_late_shelf": 64, "load_tokens_no_such_tier": 5, "hit_tokens": 64})
    assert registry.get_sample_value("vllm:kvstrata_load_tokens_total", {"model_name": "m", "tier": "late_shelf"}) == 64
    assert registry.get_sample_value("vllm:kvstrata_load_tokens_total",
                                     {"model_name": "m", "tier": "no_such_tier"}) is None  # never a label of its own
    assert registry.get_sample_value("vllm:kvstrata_hit_tokens_total", {"model_name": "m"}) == 64
