"""The connector's counters on vLLM's own metrics (`/metrics` of `vllm serve`, the periodic
"KV Transfer metrics" log line), through vLLM's connector-stats interface.

Each step, each role hands vLLM the increase of its counters (`KVStrataStats`, from
`get_kv_connector_stats`); vLLM adds the worker's and the scheduler's together and sends them
to its front-end process, which rebuilds them (`build_kv_connector_stats`) and records them
(`KVStrataPromMetrics`, from `build_prom_metrics`) as `vllm:kvstrata_*` counters beside vLLM's
own series, with vLLM's `model_name` and `engine` labels and, where a count is per tier, a
`tier` label. Separately, `hit_sources` tells vLLM which tier each hit came from, for
`vllm:prompt_tokens_cached_by_source`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.tier_factory import known_tiers
from tiers.base import TierTraits
from tiers.keys import TierKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "vllm:kvstrata_"
MAX_TIER_LABELS = 32  # `tier` label values per counter family, at most (a name from a worker is not trusted)
# Counters kept per tier: `<family>_<tier>` in the connector's stats, `tier` label in Prometheus.
TIERED = {
    "load_tokens": "Prompt tokens whose KV kvstrata copied into vLLM's blocks, by the tier read.",
    "prefetch_tokens": "Prompt tokens kvstrata moved into its CPU tier ahead of their load, by source tier.",
    "verify_tier_checked_blocks": "Tier copies verify mode compared with the KV just computed, by tier.",
    "verify_tier_mismatch_blocks": "Tier copies verify mode found beyond their bound (removed everywhere), by tier.",
}
COUNTERS = {
    "lookups": "Requests kvstrata looked up (vLLM's scheduler asked for their cached prefix).",
    "hit_requests": "Requests with a prefix served from kvstrata.",
    "hit_tokens": "Prompt tokens served from kvstrata instead of being computed.",
    "async_load_requests": "Hits loaded in the background while the request waited (disk or remote).",
    "load_error_blocks": "Blocks promised to vLLM that could not be loaded (vLLM recomputed them).",
    "unkeyable_requests": "Requests neither looked up nor saved: vLLM keys them by something kvstrata cannot.",
    "save_blocks": "Full blocks copied out of vLLM to be saved.",
    "save_new_blocks": "Saved blocks that were not in kvstrata yet.",
    "save_refused_blocks": "Blocks not saved because the store was full.",
    "save_failed_blocks": "Blocks whose background save failed.",
    "handoff_timeouts": "Consumer requests that stopped waiting for the blocks a producer said it saved.",
    "handoff_params_rejected": "Requests whose kv_transfer_params entry for kvstrata was malformed (ignored).",
    "hint_requests": "Requests that gave kvstrata hints in kv_transfer_params (store, load, retain_s, priority).",
    "hints_rejected": "Hints refused as unknown or malformed (the request's other hints still applied).",
    "retained_blocks": "Saved blocks kept in the CPU tier for a request's retain_s hint.",
    "retain_clipped_blocks": "Saved blocks a retain_s hint could not keep (over the tenant's retain_share).",
    "prioritized_blocks": "Saved blocks given a request's priority hint (low: moved to the eviction end).",
    "priority_clipped_blocks": "Saved blocks a high priority hint could not keep (over the tenant's retain_share).",
    "verify_requests": "Hits computed instead of loaded to verify them (verify_fraction, or a verify hint).",
    "verify_checked_blocks": "Blocks whose computed KV was compared with a tier's copy (verify mode).",
    "verify_mismatch_blocks": "Tier copies that differed from the KV just computed (removed from every tier).",
    "sleep_skipped_blocks": "Blocks neither loaded nor saved because vLLM's KV memory was asleep (sleep mode).",
    "policy_skipped_blocks": "Cached blocks recomputed because the load policy measured loading them slower.",
    "policy_probes": "Hits loaded whole to measure the tiers again although the load policy would skip part.",
    "prefill_samples": "Forward passes timed for the load policy's prefill rate.",
    "prefill_samples_rejected": "Forward-pass timings the load policy rejected as impossible.",
    "policy_rate_updates": "Times the scheduler's load policy took new rates from workers in other processes.",
    "policy_rates_rejected": "Worker rate reports the scheduler refused as malformed or impossible.",
}


def source_of(traits: TierTraits) -> CacheHitSource:
    """Where vLLM's `prompt_tokens_cached_by_source` puts a hit from a tier with `traits`: the
    engine's own memory is the device, other memory the host, a tier shared across hosts is
    external (vLLM's label for a remote store), a local persistent one the disk."""
    if traits.engine_memory:
        return CacheHitSource.DEVICE
    if traits.shared:
        return CacheHitSource.EXTERNAL_UNSPECIFIED
    if traits.memory:
        return CacheHitSource.HOST
    if traits.persistent:
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED


def tier_labels() -> list[str]:
    """The tiers a load reads from (every registered one but the engine's own paged memory),
    by name, as registered now: a tier loaded later from its `module_path` is among them."""
    return [kind.value for kind, traits in known_tiers().items() if not traits.engine_memory]


@dataclass
class KVStrataStats(KVConnectorStats):
    """Counter increases of one interval, `data`: counter name -> increase (plain ints, so it
    pickles from the worker and travels as msgpack to the front end)."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVStrataStats:
        """Add `other`'s increases to these (the worker's and the scheduler's, or intervals)."""
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStrataPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvstrata_*` counters in vLLM's Prometheus registry, per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[tuple[int, str], Any] = {}  # (engine, counter name) -> bound counter
        self._tiered: dict[str, Any] = {}  # family -> its counter, labelled by tier
        self._labelvalues = per_engine_labelvalues
        self._tiers: set[str] = set()
        for family, doc in TIERED.items():
            self._tiered[family] = self._counter_cls(name=PREFIX + family, documentation=doc,
                                                     labelnames=[*labelnames, "tier"])
        for tier in tier_labels():
            self._add_tier(tier)
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._children[engine, name] = counter.labels(*values)

    def _add_tier(self, tier: str) -> None:
        """Bind every tiered counter to `tier` for every engine."""
        self._tiers.add(tier)
        for family, counter in self._tiered.items():
            for engine, values in self._labelvalues.items():
                self._children[engine, f"{family}_{tier}"] = counter.labels(*values, tier)

    def _tier_of(self, name: str) -> str | None:
        """The tier of a tiered counter's name not bound yet, if it names a tier registered now
        (a tier loaded after these metrics were made) and the labels are not all taken."""
        for family in TIERED:
            tier = name.removeprefix(family + "_")
            if tier != name and tier not in self._tiers and len(self._tiers) < MAX_TIER_LABELS \
                    and tier in tier_labels():
                return tier
        return None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's increases (counters this version does not know are skipped)."""
        for name, n in transfer_stats_data.items():
            child = self._children.get((engine_idx, name))
            if child is None and (tier := self._tier_of(name)) is not None:
                self._add_tier(tier)
                child = self._children.get((engine_idx, name))
            if child is not None and n > 0:
                child.inc(n)


def hit_sources(kinds: Sequence[TierKind], num_tokens: int, block_size: int) -> dict[CacheHitSource, int]:
    """`num_tokens` of a hit split by the vLLM source of the tier of each of its blocks
    (`kinds`, in order), read from the traits of the tiers registered now; a partial last
    block goes with its tier. Empty if `kinds` cannot account for them, or name a tier that is
    not registered (vLLM then counts the hit as `external_unspecified`)."""
    if num_tokens <= 0 or len(kinds) * block_size < num_tokens:
        return {}
    traits = known_tiers()
    if any(kind not in traits for kind in kinds):
        return {}
    sources: dict[CacheHitSource, int] = {}
    left = num_tokens
    for kind in kinds:
        take = min(block_size, left)
        if take == 0:
            break
        source = source_of(traits[kind])
        sources[source] = sources.get(source, 0) + take
        left -= take
    return sources
