"""Prometheus metrics of `KVCacheStore`s (needs the `metrics` extra: `prometheus_client`).

`register_metrics(store)` adds the store to its registry's one `StoreCollector` (the default
registry unless given): every scrape reads each live store's `stats()` and its tiers'
counters (and, for a tier with tenant quotas, each tenant's share under a hashed `tenant`
label: only tenants holding blocks, at most `tiers.policies.quota.LABELLED_TENANTS` a tier, the rest
and the departed summed under `tenant="other"`), so a store's hot path does no metric work
beyond timing its calls into one latency histogram. Labels: `namespace` (a short digest of
the store's namespace seed), `store` (which store of the process: several may share a
registry) and `tier` (`pool`, `cpu`, `disk`, `remote`). Names and example queries:
`docs/metrics.md`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError, StoreClosedError
from tiers.base import TenantStats, TierStats

if TYPE_CHECKING:
    from kvstore.store import KVCacheStore, StoreStats

LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
LATENCY_OPS = ("store", "retrieve", "load")  # the calls `KVCacheStore` times
DEFAULT_NAME = "store"

# name -> (help, type, value of one tier's stats)
_PER_TIER: dict[str, tuple[str, str, Callable[[TierStats, int], int]]] = {
    "kvstrata_hit_tokens": ("Tokens served from each tier by retrieve/load", "counter",
                            lambda t, block: t.num_hits * block),
    "kvstrata_blocks_stored": ("Blocks each tier wrote (stores, demotions, promotions)", "counter",
                               lambda t, _: t.num_puts),
    "kvstrata_blocks_evicted": ("Blocks each tier evicted (demoted down where a tier is below)", "counter",
                                lambda t, _: t.num_evictions),
    "kvstrata_corrupt_records": ("Blocks that failed validation and were deleted", "counter",
                                 lambda t, _: t.num_corrupt),
    "kvstrata_blocks": ("Blocks each tier holds now (0 where unknown: remote)", "gauge", lambda t, _: t.num_blocks),
    "kvstrata_used_bytes": ("Bytes each tier uses now", "gauge", lambda t, _: t.used_bytes),
    "kvstrata_capacity_bytes": ("Capacity of each tier in bytes", "gauge", lambda t, _: t.capacity_bytes),
}
# name -> (help, type, value of one tenant's share of a tier), labelled by the tenant's hash
_PER_TENANT: dict[str, tuple[str, str, Callable[[TenantStats], int]]] = {
    "kvstrata_tenant_blocks": ("Blocks each tenant holds in a tier with quotas", "gauge", lambda t: t.num_blocks),
    "kvstrata_tenant_quota_blocks": ("Each tenant's quota in blocks", "gauge", lambda t: t.quota_blocks),
    "kvstrata_tenant_hits": ("Blocks each tenant read from a tier", "counter", lambda t: t.num_hits),
    "kvstrata_tenant_blocks_stored": ("Blocks each tenant wrote into a tier", "counter", lambda t: t.num_puts),
    "kvstrata_tenant_blocks_evicted": ("Blocks of each tenant a tier evicted", "counter", lambda t: t.num_evictions),
}
# name -> (help, value of the store's stats)
_PER_STORE: dict[str, tuple[str, Callable[[StoreStats], int]]] = {
    "kvstrata_requested_tokens": ("Tokens asked for by retrieve/load", lambda s: s.num_tokens_requested),
    "kvstrata_hit_tokens_all": ("Tokens served from any tier", lambda s: s.num_tokens_hit),
    "kvstrata_lookups": ("lookup() and engine API lookup() calls", lambda s: s.num_lookup_calls),
    "kvstrata_store_calls": ("store() and engine API save() calls", lambda s: s.num_store_calls),
    "kvstrata_retrieve_calls": ("retrieve() and engine API load() calls", lambda s: s.num_retrieve_calls),
    "kvstrata_promotion_failures": ("Promotions a full tier refused", lambda s: s.num_promotion_failures),
    "kvstrata_verified_blocks": ("Blocks verify mode compared with a tier's copy", lambda s: s.num_verified_blocks),
    "kvstrata_prefetch_calls": ("prefetch() calls", lambda s: s.num_prefetch_calls),
    "kvstrata_prefetch_dropped": ("Prefetches dropped: too many waited", lambda s: s.num_prefetch_dropped),
    "kvstrata_prefetch_promoted_blocks": ("Blocks prefetches moved from slow tiers into memory",
                                          lambda s: s.num_prefetch_promoted),
    "kvstrata_prefetch_failed_blocks": ("Blocks prefetches could not read, and prefetches a fault ended",
                                        lambda s: s.num_prefetch_failed),
}


def prometheus() -> Any:
    """The prometheus_client module, or a `ConfigError` naming the extra that installs it."""
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("kvstrata metrics need prometheus_client: pip install 'kvstrata[metrics]'") from None
    return prometheus_client


class StoreCollector:
    """The stores registered in one registry, read at scrape time (a prometheus_client custom
    collector; one per registry). Every family is exported once, with a sample per store.

    Invariant: names are unique among the stores held; a closed store is dropped (at the next
    registration or scrape) with its latency series, freeing its name.
    """

    def __init__(self, registry: Any) -> None:
        prom = prometheus()
        self._lock = threading.Lock()
        self._stores: dict[str, KVCacheStore] = {}
        self.latency = prom.Histogram("kvstrata_latency_seconds", "Wall time of store calls",
                                      ["namespace", "store", "op"], buckets=LATENCY_BUCKETS, registry=None)
        registry.register(self)

    @staticmethod
    def namespace(store: KVCacheStore) -> str:
        return bytes(store.seed).hex()[:8]

    def _prune(self) -> None:
        """Drop closed stores and their latency series (call with `_lock` held)."""
        for name, store in list(self._stores.items()):
            if store.closed:
                del self._stores[name]
                for op in LATENCY_OPS:
                    self.latency.remove(self.namespace(store), name, op)

    def add(self, store: KVCacheStore, name: str | None) -> str:
        """Hold `store` under `name` (default: its `instance_id`, else `store`, with `-2`, `-3`,
        ... appended while taken); return the name. The same store again: its name."""
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"register_metrics name must be a non-empty str, got {name!r}")
        with self._lock:
            self._prune()
            held = next((n for n, s in self._stores.items() if s is store), None)
            if held is not None:
                if name is not None and name != held:
                    raise ConfigError(f"this store is already registered as {held!r}, not {name!r}")
                return held
            if name is not None and name in self._stores:
                raise ConfigError(f"a store named {name!r} is already registered in this registry: "
                                  "pass another name= to register_metrics")
            if name is None:
                base = store.config.instance_id or DEFAULT_NAME
                name = next(n for n in (base, *(f"{base}-{i}" for i in range(2, len(self._stores) + 3)))
                            if n not in self._stores)
            self._stores[name] = store
        self._observe(store, name)
        return name

    def _observe(self, store: KVCacheStore, name: str) -> None:
        """Time `store`'s calls into this registry's histogram (and any registry before)."""
        ns = self.namespace(store)
        children = {op: self.latency.labels(ns, name, op) for op in LATENCY_OPS}
        previous = store.observe_latency

        def observe(op: str, seconds: float) -> None:
            child = children.get(op)
            (child if child is not None else self.latency.labels(ns, name, op)).observe(seconds)
            if previous is not None:
                previous(op, seconds)

        store.observe_latency = observe

    def describe(self) -> Iterator[Any]:
        return self._families([])

    def collect(self) -> Iterator[Any]:
        with self._lock:
            self._prune()
            stores = list(self._stores.items())
        snapshots: list[tuple[str, KVCacheStore, StoreStats]] = []
        for name, store in stores:
            try:
                snapshots.append((name, store, store.stats()))
            except StoreClosedError:  # closed since: dropped at the next scrape
                continue
        return self._families(snapshots)

    def _families(self, snapshots: list[tuple[str, KVCacheStore, StoreStats]]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        tier_labels = ["namespace", "store", "tier"]
        for metric, (doc, kind, value) in _PER_TIER.items():
            family = _family(metric, doc, kind, tier_labels)
            for name, store, stats in snapshots:
                for tier in stats.tiers:
                    family.add_metric([self.namespace(store), name, tier.kind.value],
                                      float(value(tier, store.config.block_size)))
            yield family
        errors = CounterMetricFamily("kvstrata_tier_errors", "Server or disk faults turned into misses or skipped "
                                     "writes", labels=tier_labels)
        drops = CounterMetricFamily("kvstrata_write_drops", "Writes skipped for a fault or a full queue",
                                    labels=tier_labels)
        mismatches = CounterMetricFamily("kvstrata_verify_mismatch", "Blocks verify mode found differing from the "
                                         "KV just computed (removed from every tier)", labels=tier_labels)
        for name, store, stats in snapshots:
            for tier in stats.tiers:  # 0 for tiers whose medium does not fail on its own
                labels = [self.namespace(store), name, tier.kind.value]
                errors.add_metric(labels, float(tier.num_errors))
                drops.add_metric(labels, float(tier.num_write_drops))
                mismatches.add_metric(labels, float(stats.verify_mismatches.get(tier.kind, 0)))
        yield errors
        yield drops
        yield mismatches
        worst = _family("kvstrata_verify_max_error", "The largest element error verify mode saw in a tier's copy",
                        "gauge", tier_labels)
        bound = _family("kvstrata_verify_bound", "The largest element error verify mode allowed (0: byte for byte)",
                        "gauge", tier_labels)
        for name, store, stats in snapshots:
            for kind, err in stats.verify_max_error.items():
                worst.add_metric([self.namespace(store), name, kind.value], err)
            for kind, allowed in stats.verify_bound.items():
                bound.add_metric([self.namespace(store), name, kind.value], allowed)
        yield worst
        yield bound
        yield from self._tenant_families(snapshots)
        for metric, (doc, count) in _PER_STORE.items():
            family = CounterMetricFamily(metric, doc, labels=["namespace", "store"])
            for name, store, stats in snapshots:
                family.add_metric([self.namespace(store), name], float(count(stats)))
            yield family
        yield from self.latency.collect()

    def _tenant_families(self, snapshots: list[tuple[str, KVCacheStore, StoreStats]]) -> Iterator[Any]:
        """Per-tenant shares of the tiers that keep quotas, labelled by the tenant's hash
        (`tenant`: 16 hex digits, `default` for blocks without one, `other` for the sum of
        the rest), never its salt. Bounded: the tier reports its labelled tenants only."""
        labels = ["namespace", "store", "tier", "tenant"]
        for metric, (doc, kind, value) in _PER_TENANT.items():
            family = _family(metric, doc, kind, labels)
            for name, store, stats in snapshots:
                for tier in stats.tiers:
                    for tenant in tier.tenants:
                        family.add_metric([self.namespace(store), name, tier.kind.value, tenant.label],
                                          float(value(tenant)))
            yield family


def _family(metric: str, doc: str, kind: str, labels: list[str]) -> Any:
    """An empty counter (`kind` "counter") or gauge family of `metric` with `labels`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(metric, doc, labels=labels)


_COLLECTORS: weakref.WeakKeyDictionary[Any, StoreCollector] = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


def register_metrics(store: KVCacheStore, registry: Any = None, *, name: str | None = None) -> str:
    """Export `store`'s metrics to `registry` (default: prometheus_client's REGISTRY) under the
    label `store=name`, and time its store/retrieve/load calls into
    `kvstrata_latency_seconds{op=...}`. Returns the name.

    `name` defaults to the store's `instance_id`, else `store`; a default name already taken in
    the registry gets `-2`, `-3`, ... appended. Registering the same store again returns its
    name and changes nothing. Raises `ConfigError` without prometheus_client, for a bad
    `name`, for a `name` another open store holds in the registry, or for a registry that
    already holds `kvstrata_*` metrics of its own making.
    """
    prom = prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _COLLECTORS_LOCK:
        collector = _COLLECTORS.get(registry)
        if collector is None:
            try:
                collector = StoreCollector(registry)
            except ValueError as exc:  # DuplicateTimeseries: names taken by another collector
                raise ConfigError(f"this registry already exports kvstrata metrics not made here: {exc}") from None
            _COLLECTORS[registry] = collector
    return collector.add(store, name)
