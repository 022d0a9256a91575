"""`TierKVConnector`: vLLM's KV connector API backed by kvstrata's CPU and LMDB tiers.

Load it by its registered name, `KVTransferConfig(kv_connector="KVStrataConnector",
kv_role="kv_both", kv_connector_extra_config={...})` (kvstrata's `vllm.general_plugins`
entry point registers it, `plugin.py`), or by module path:
`kv_connector="TierKVConnector"` (or `"KVStrataConnector"`) with
`kv_connector_module_path="engine_adapter.vllm.connector"`. Settings are in
`engine_adapter/vllm/settings.py`.

One class per role does the work: `ConnectorScheduler` (scheduler_side.py) looks up the
longest stored prefix beyond vLLM's own hit under the request's isolation keys, and plans per
step which blocks to load and which newly completed blocks to save; `GroupedWorker`
(group_worker.py) copies whole blocks as bytes, one `ConnectorWorker` (worker_side.py) per
KV cache group. There is one store per KV cache group and distinct tensor-parallel shard or
pipeline stage (`store_config.py`); vLLM's hybrid KV cache manager is supported
(`SupportsHMA`), and each group keeps the blocks its kind of attention needs (`groups.py`).

Processes: when the scheduler and the worker share a process they share the stores; when they
do not (vLLM's default multiprocess mode, and always under tensor or pipeline parallelism),
the scheduler opens disk-only views of every worker's stores under the same `disk_path`, sees
what the workers wrote through to it, and calls a block a hit only where all of them hold it;
the workers' load-policy rates reach it through vLLM's worker-to-scheduler metadata
(`policy_rates.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from engine_adapter.control import ControlListener
from engine_adapter.vllm.control_setup import open_control
from engine_adapter.vllm.engine_metrics import KVStrataPromMetrics, KVStrataStats, hit_sources
from engine_adapter.vllm.group_lookup import GroupLookup
from engine_adapter.vllm.group_worker import GroupedWorker
from engine_adapter.vllm.metrics_server import serve_metrics
from engine_adapter.vllm.parallel import Place, parallel_sizes, this_worker
from engine_adapter.vllm.policy_rates import RatesBook, WorkerRates
from engine_adapter.vllm.scheduler_side import ConnectorScheduler
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.shared_store import acquire_store, find_store, release_store
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.store_config import StorePlanner
from engine_adapter.vllm.transfer_plan import StepPlan
from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError
from kvstore.tier_factory import known_tiers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class TierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one step."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TierWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: their load-policy rates, where they
    changed (vLLM gathers every worker's of the step with `aggregate`)."""

    reports: tuple[WorkerRates, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TierWorkerMetadata:
        extra = other.reports if isinstance(other, TierWorkerMetadata) else ()
        return TierWorkerMetadata(self.reports + extra)


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """A prefix cache for vLLM in kvstrata's CPU, disk and remote tiers."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_sources(self._kv_transfer_config.kv_connector_extra_config)
        self.store_planner = StorePlanner(vllm_config, kv_cache_config, self.settings)
        self._stats = ConnectorStats(role.name.lower(), self.settings.stats_path)
        self._store_keys: list[StoreConfig] = []
        self._worker: GroupedWorker | None = None
        self._scheduler: ConnectorScheduler | None = None
        self._hit_sources: dict[str, dict[CacheHitSource, int]] = {}  # request -> its hit by source
        self._place = Place(1, 0, 1, 0)
        self._control: ControlListener | None = None  # `control_endpoint`'s listener (worker side)
        self._rates_sent: WorkerRates | None = None  # the worker's last report to the scheduler
        self._rates: RatesBook | None = None  # the scheduler's record of them (workers elsewhere)
        # With several KV cache groups vLLM takes no failed block ids: every load runs in the
        # background, and a failed one makes vLLM recompute the request whole.
        several = len(kv_cache_config.kv_cache_groups) > 1
        if role == KVConnectorRole.WORKER:
            place = self._place = this_worker(vllm_config)
            self.store_planner.publish(place)
            stores = self.store_planner.worker_stores(place)
            if not stores:
                raise ConfigError(f"kvstrata: worker {place} holds no KV cache layer")
            opened = [(gs, self._open(gs.config)) for gs in stores]
            primary = next((store for gs, store in opened if gs.group == self.store_planner.primary), opened[0][1])
            self.store_config = primary.config
            if self.settings.metrics_port is not None and place.rank == 0:  # one server per port
                serve_metrics(primary, self.settings.metrics_port, self.settings.metrics_host)
            try:
                self._control = open_control(self.settings, [store for _, store in opened],
                                             len(self.store_planner.places), self._stats.count)
            except ConfigError:
                self.shutdown()  # the stores this refused connector opened
                raise
            self._worker = GroupedWorker(opened, self.store_planner.primary, kv_cache_config.num_blocks, self._stats,
                                         async_saves=self.settings.async_saves, fail_whole_requests=several,
                                         verify_tolerance=self.settings.verify_tolerance)
        else:
            lookup, shared = self._open_scheduler_stores()
            primary_store = lookup.stores[lookup.primary][0]
            self.store_config = primary_store.config
            if not shared:  # the workers measure in other processes: their rates come with their output
                tp, pp = parallel_sizes(vllm_config)
                self._rates = RatesBook(tp, pp, primary_store.config.block_bytes,
                                        [t.kind for t in primary_store.tiers],
                                        frozenset(kind.value for kind in known_tiers()))
            if several and not self.settings.async_loads:
                logger.warning("kvstrata: async_loads is off but this model has several KV cache groups: its loads "
                               "run in the background anyway (vLLM can then recompute a failed one)")
            kv_role = self._kv_transfer_config.kv_role  # a producer never loads, a consumer never saves
            self._scheduler = ConnectorScheduler(
                primary_store, self.store_planner.block_size, self._stats,
                async_saves=self.settings.async_saves, async_loads=self.settings.async_loads, lookup=lookup,
                verify_fraction=self.settings.verify_fraction,
                async_only=several, loads=kv_role != "kv_producer", saves=kv_role != "kv_consumer")
        logger.info("kvstrata connector (%s) over %s: %d KV cache group(s)", role.name,
                    self.settings.disk_dir, len(kv_cache_config.kv_cache_groups))

    def _open(self, config: StoreConfig) -> KVCacheStore:
        self._store_keys.append(config)
        return acquire_store(config)

    def _open_scheduler_stores(self) -> tuple[GroupLookup, bool]:
        """The scheduler's stores: the worker's own where it lives in this process (True: shared,
        with their load policy), else disk-only views of every worker's stores (False)."""
        rules, primary = self.store_planner.rules, self.store_planner.primary
        own = self.store_planner.worker_stores(Place(1, 0, 1, 0)) if len(self.store_planner.places) == 1 else []
        if own and all(find_store(gs.config) is not None for gs in own):  # share the worker's tiers
            stores: list[list[KVCacheStore]] = [[] for _ in rules]
            for gs in own:
                stores[gs.group].append(self._open(gs.config))
            return GroupLookup(rules, stores, primary), True
        if self.settings.disk_dir is None:
            raise ConfigError(
                "kvstrata: the vLLM scheduler runs in another process than the workers "
                "(multiprocess mode, or tensor/pipeline parallelism); set disk_path (or a disk in tiers) so that "
                "it can see what they store, or run one worker with VLLM_ENABLE_V1_MULTIPROCESSING=0"
            )
        if not self.settings.write_through:
            logger.warning("kvstrata: scheduler and workers are in different processes and write_through is off: "
                           "the scheduler sees blocks only once they reach disk")
        views = [[self._open(c) for c in configs] for configs in self.store_planner.every_shard()]
        return GroupLookup(rules, views, primary), False

    @property
    def worker(self) -> GroupedWorker:
        if self._worker is None:
            raise RuntimeError("kvstrata: worker-side call on a scheduler connector (or after shutdown)")
        return self._worker

    @property
    def scheduler(self) -> ConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("kvstrata: scheduler-side call on a worker connector (or after shutdown)")
        return self._scheduler

    # ==============================  worker side  ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM's sleep mode (0.33's check at start-up): the worker follows it through
        `unregister_kv_caches` / `restore_kv_caches`."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM is about to free its KV memory (sleep): no copy touches it until
        `restore_kv_caches`; meanwhile a step's loads and saves are skipped and counted."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM's KV memory is back (wake-up): the worker's views of it are rebuilt."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's store hits into vLLM's blocks (synchronously, before the forward)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierConnectorMetadata)
        self.worker.load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` finished every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are saved in `wait_for_save`, after the forward."""

    def wait_for_save(self) -> None:
        """Copy this step's newly completed full blocks out of vLLM into the store."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierConnectorMetadata)
        self.worker.save(meta.plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s two sets, and (several KV cache groups) the requests whose
        background load failed among those it reports ended."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self.worker.take_failed_loads(recving))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose delayed free may happen now, requests whose background load ended)."""
        return self.worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """After each step: this worker's load-policy rates where they changed since its last
        report (the scheduler may run in another process: `update_connector_output`)."""
        rates = self.worker.rates(self._place.pp_rank, self._place.tp_rank)
        if rates == self._rates_sent:
            return None
        self._rates_sent = rates
        return TierWorkerMetadata((rates,))

    def shutdown(self) -> None:
        """Release the stores (the last user of each in this process flushes and closes it)."""
        if self._control is not None:  # no prefetch starts once the stores close
            self._control.close()
            self._control = None
        if self._worker is not None:
            self._worker.flush()  # queued saves land before the stores close
        if self._store_keys:
            self._count_policy()  # (vLLM may not have asked for stats since the last decision)
            self._stats.write()
            for config in self._store_keys:
                release_store(config)
            self._store_keys = []
            self._worker = self._scheduler = None

    # ==============================  scheduler side  ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """kvstrata's hit beyond vLLM's own (None: ask again later: a consumer waiting for the
        blocks a producer saved, `handoff.py`), and whether it loads in the background."""
        num_tokens, load_async = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        if num_tokens is not None:
            self._note_hit_sources(request.request_id, num_computed_tokens, num_tokens)
        return num_tokens, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids() if blocks is not None else ()
        self.scheduler.update_state_after_alloc(request, num_external_tokens, [list(g) for g in ids])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._count_policy()  # this step's decisions reach the stats file `build_plan` writes
        return TierConnectorMetadata(self.scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A step's output from the workers: where they run in other processes, their load-policy
        rates become this scheduler's (`policy_rates.py`)."""
        meta = connector_output.kv_connector_worker_meta
        if self._rates is None or meta is None:
            return
        reports = meta.reports if isinstance(meta, TierWorkerMetadata) else (meta,)  # anything else: refused
        if self._rates.take(reports) and self._rates.apply(self.scheduler.store.load_policy):
            self._stats.count("policy_rate_updates", 1)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._hit_sources.pop(request.request_id, None)
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: the request finished in every KV cache group."""
        self._hit_sources.pop(request.request_id, None)
        return self.scheduler.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ==============================  vLLM's metrics and timing  ==============================
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's plan; vLLM runs the forward pass next (the load policy times it)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_begins()

    def finish_forward(self) -> None:
        """vLLM's forward pass of this step has ended (the v2 GPU model runner says so)."""
        if self._worker is not None:
            self._worker.forward_ended()

    def _note_hit_sources(self, req_id: str, num_computed_tokens: int, num_tokens: int) -> None:
        if num_tokens > 0:
            kinds = self.scheduler.hit_kinds(num_computed_tokens, num_tokens)
            self._hit_sources[req_id] = hit_sources(kinds, num_tokens, self.store_config.block_size)
        else:
            self._hit_sources.pop(req_id, None)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The request's kvstrata hit split by the tier its lookup found each block in (host:
        the CPU tier, disk: LMDB, external_unspecified: the remote tier), for vLLM's
        `prompt_tokens_cached_by_source`. In multiprocess mode the scheduler's view of the store
        has no CPU tier: a hit there is `disk` even where the worker reads its CPU copy."""
        sources = self._hit_sources.pop(request.request_id, {})
        if num_external_tokens <= 0:
            return {}
        if sum(sources.values()) != num_external_tokens:
            fallback: dict[CacheHitSource, int] = super().get_external_cache_hit_sources(request, num_external_tokens)
            return fallback
        return sources

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This role's counter increases since the last call (None if none): vLLM adds the
        worker's and the scheduler's and records them (`build_prom_metrics`)."""
        self._count_policy()
        deltas = self._stats.take_deltas()
        return KVStrataStats(data=deltas) if deltas else None

    def _count_policy(self) -> None:
        """Copy the scheduler's load-policy counters into this role's stats."""
        if self._scheduler is not None:
            policy = self._scheduler.store.load_policy
            self._stats.set("policy_skipped_blocks", policy.num_blocks_skipped)
            self._stats.set("policy_probes", policy.num_probes)
            if self._rates is not None:
                self._stats.set("policy_rates_rejected", self._rates.rejected)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStrataStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """`vllm:kvstrata_*` counters on vLLM's `/metrics` (engine_metrics.py)."""
        return KVStrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# The name the plugin registers (`kv_connector="KVStrataConnector"`), also importable by module path.
KVStrataConnector = TierKVConnector
