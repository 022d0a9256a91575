"""Prometheus metrics of a `KVCacheStore` (needs the `metrics` extra: `prometheus_client`).

`register_metrics(store)` adds one collector to a registry (the default one unless given):
every scrape reads `store.stats()` and each tier's counters, so the store's hot path does no
metric work beyond timing its calls into three latency histograms. Labels: `tier` (`pool`,
`cpu`, `disk`, `remote`) and `namespace`, a short digest of the store's namespace seed.
Names and example queries: `docs/metrics.md`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tiers.base import TierStats

if TYPE_CHECKING:
    from kvstore.store import KVCacheStore

LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


def prometheus() -> Any:
    """The prometheus_client module, or a `ConfigError` naming the extra that installs it."""
    try:
        import prometheus_client
    except ImportError:
        from kvstore.errors import ConfigError

        raise ConfigError("kvstrata metrics need prometheus_client: pip install 'kvstrata[metrics]'") from None
    return prometheus_client


class StoreCollector:
    """Reads a store's counters at scrape time (a prometheus_client custom collector)."""

    def __init__(self, store: KVCacheStore, namespace: str) -> None:
        self.store = store
        self.namespace = namespace

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.store.closed:
            return
        stats = self.store.stats()
        ns = self.namespace
        block = self.store.config.block_size
        per_tier: dict[str, tuple[str, str, Callable[[TierStats], int]]] = {
            "kvstrata_hit_tokens": ("Tokens served from each tier by retrieve/load", "counter",
                                    lambda t: t.num_hits * block),
            "kvstrata_blocks_stored": ("Blocks each tier wrote (stores, demotions, promotions)", "counter",
                                       lambda t: t.num_puts),
            "kvstrata_blocks_evicted": ("Blocks each tier evicted (demoted down where a tier is below)", "counter",
                                        lambda t: t.num_evictions),
            "kvstrata_corrupt_records": ("Blocks that failed validation and were deleted", "counter",
                                         lambda t: t.num_corrupt),
            "kvstrata_blocks": ("Blocks each tier holds now (0 where unknown: remote)", "gauge",
                                lambda t: t.num_blocks),
            "kvstrata_used_bytes": ("Bytes each tier uses now", "gauge", lambda t: t.used_bytes),
            "kvstrata_capacity_bytes": ("Capacity of each tier in bytes", "gauge", lambda t: t.capacity_bytes),
        }
        for name, (doc, kind, value) in per_tier.items():
            family: Any = (CounterMetricFamily(name, doc, labels=["namespace", "tier"]) if kind == "counter"
                           else GaugeMetricFamily(name, doc, labels=["namespace", "tier"]))
            for tier in stats.tiers:
                family.add_metric([ns, tier.kind.value], float(value(tier)))
            yield family
        errors = CounterMetricFamily("kvstrata_tier_errors", "Server or disk faults turned into misses or skipped "
                                     "writes", labels=["namespace", "tier"])
        drops = CounterMetricFamily("kvstrata_write_drops", "Writes skipped for a fault or a full queue",
                                    labels=["namespace", "tier"])
        for medium in self.store.tiers:
            if hasattr(medium, "num_errors"):
                errors.add_metric([ns, medium.kind.value], float(medium.num_errors))
                drops.add_metric([ns, medium.kind.value], float(getattr(medium, "num_write_drops", 0)))
        yield errors
        yield drops
        store_counters: tuple[tuple[str, str, int], ...] = (
            ("kvstrata_requested_tokens", "Tokens asked for by retrieve/load", stats.num_tokens_requested),
            ("kvstrata_hit_tokens_all", "Tokens served from any tier", stats.num_tokens_hit),
            ("kvstrata_lookups", "lookup() calls", stats.num_lookup_calls),
            ("kvstrata_store_calls", "store()/store_blocks() calls", stats.num_store_calls),
            ("kvstrata_retrieve_calls", "retrieve()/retrieve_into() calls", stats.num_retrieve_calls),
            ("kvstrata_promotion_failures", "Promotions a full tier refused", stats.num_promotion_failures),
        )
        for name, doc, count in store_counters:
            family = CounterMetricFamily(name, doc, labels=["namespace"])
            family.add_metric([ns], float(count))
            yield family


def register_metrics(store: KVCacheStore, registry: Any = None) -> StoreCollector:
    """Export `store`'s metrics to `registry` (default: prometheus_client's REGISTRY) and time
    its store/retrieve/load calls into `kvstrata_latency_seconds{op=...}`. Raises
    `ConfigError` without prometheus_client."""
    prom = prometheus()
    registry = prom.REGISTRY if registry is None else registry
    namespace = bytes(store.seed).hex()[:8]
    collector = StoreCollector(store, namespace)
    registry.register(collector)
    latency = prom.Histogram("kvstrata_latency_seconds", "Wall time of store calls", ["namespace", "op"],
                             buckets=LATENCY_BUCKETS, registry=registry)
    store.observe_latency = lambda op, seconds: latency.labels(namespace, op).observe(seconds)
    return collector
