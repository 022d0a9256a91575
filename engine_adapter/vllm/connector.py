"""`TierKVConnector`: vLLM's KV connector API backed by kvstrata's CPU and LMDB tiers.

Load it with `KVTransferConfig(kv_connector="TierKVConnector",
kv_connector_module_path="engine_adapter.vllm.connector", kv_role="kv_both",
kv_connector_extra_config={...})`; settings are in `engine_adapter/vllm_settings.py`.

Scheduler side: looks up the longest stored prefix beyond vLLM's own hit, and plans per step
which blocks to load (before the forward pass) and which newly completed full blocks to
save (after it). Worker side: copies whole blocks as bytes between vLLM's paged KV and the
store, synchronously, so nothing waits on `get_finished`. Keys are chained token hashes in a
namespace naming the model, vLLM version, KV cache layout, spec, dtype and block size.

Processes: when the scheduler and the worker share a process they share one store; when they
do not (vLLM's default multiprocess mode), the scheduler opens a disk-only view of the same
`disk_path` and sees what the worker wrote through to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine_adapter.vllm.keys import request_keys
from engine_adapter.vllm.paged_blocks import PagedKVBlocks, opaque_layout
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.shared_store import acquire_store, find_store, release_store
from engine_adapter.vllm.transfer_plan import StepPlan, TransferPlanner
from engine_adapter.vllm.weights_identity import weights_identity
from kvstore import ExtraKeys, KVCacheStore, StoreConfig
from kvstore.errors import ConfigError, DiskFullError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class TierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one step."""

    plan: StepPlan = field(default_factory=StepPlan)


# Keys of a HF config that describe where or by what it was saved, not the model.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset")


def model_identity(vllm_config: VllmConfig) -> dict[str, object]:
    """Everything of vLLM's config that changes the KV a model computes, host-independent:
    the weights' content digests, the effective HF config (after `hf_overrides`: RoPE,
    layers, ...), model dtype, quantization, KV cache dtype and scaling."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf_config = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else dict(vars(model.hf_config))
    for key in _CONFIG_NOISE:
        hf_config.pop(key, None)
    return {
        "weights": weights_identity(model.model, model.revision),
        "hf_config": hf_config,
        "model_dtype": str(model.dtype),
        "quantization": model.quantization,
        "override_attention_dtype": getattr(model, "override_attention_dtype", None),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None),
    }


def store_config_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
) -> StoreConfig:
    """The `StoreConfig` both roles derive from vLLM's config (they must agree exactly)."""
    import vllm

    parallel = vllm_config.parallel_config
    if parallel.world_size != 1:
        raise ConfigError(
            f"TierKVConnector supports tensor/pipeline parallel size 1, got world size "
            f"{parallel.world_size}"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"TierKVConnector needs one KV cache group, got {len(groups)}")
    spec = groups[0].kv_cache_spec
    layer_names = list(groups[0].layer_names)
    identity = {
        "engine": "vllm",
        "vllm": vllm.__version__,
        "model": model_identity(vllm_config),
        "layout": str(kv_cache_config.kv_cache_layout),
        "spec": type(spec).__name__,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "head_size_v": getattr(spec, "head_size_v", spec.head_size),
        "dtype": str(spec.dtype),
        "block_size": spec.block_size,
        "page_size_bytes": spec.page_size_bytes,
        "layers": layer_names,
        "user": settings.namespace,
    }
    return StoreConfig(
        layout=opaque_layout(len(layer_names), spec.page_size_bytes, spec.block_size),
        block_size=spec.block_size,
        namespace=json.dumps(identity, sort_keys=True, default=str),
        cpu_bytes=settings.cpu_bytes,
        disk_path=settings.disk_path,
        disk_bytes=settings.disk_bytes,
        hash_algo=settings.hash_algo,
        verify_tokens=settings.verify_tokens,
        disk_sync=settings.disk_sync,
        write_through=settings.write_through and settings.disk_path is not None,
    )


class TierKVConnector(KVConnectorBase_V1):
    """A prefix cache for vLLM in kvstrata's CPU and disk tiers; synchronous loads and saves."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_sources(extra)
        self.store_config = store_config_for(vllm_config, kv_cache_config, self.settings)
        self._block_size = self.store_config.block_size
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._num_blocks = kv_cache_config.num_blocks
        self._counters: dict[str, int] = {}
        self._store: KVCacheStore | None = None
        self._store_key: StoreConfig | None = None
        if role == KVConnectorRole.WORKER:
            self._open(self.store_config)
            self._paged: PagedKVBlocks | None = None
            self._load_errors: set[int] = set()
        else:
            shared = find_store(self.store_config)
            if shared is not None:  # the worker lives in this process: share its tiers
                self._open(self.store_config)
            elif self.settings.disk_path is not None:
                self._open(dataclasses.replace(self.store_config, cpu_bytes=0, write_through=False))
                if not self.settings.write_through:
                    logger.warning(
                        "kvstrata: scheduler and worker are in different processes and "
                        "write_through is off: the scheduler sees blocks only once they "
                        "reach disk"
                    )
            else:
                raise ConfigError(
                    "kvstrata: the vLLM scheduler runs in another process than the worker "
                    "(multiprocess mode); set disk_path so that both can reach the store, "
                    "or run with VLLM_ENABLE_V1_MULTIPROCESSING=0"
                )
            self._planner = TransferPlanner(self._block_size, self._lookup)
        logger.info("kvstrata connector (%s) over %s", role.name, self.store_config.disk_path)

    def _open(self, config: StoreConfig) -> None:
        self._store = acquire_store(config)
        self._store_key = config

    @property
    def store(self) -> KVCacheStore:
        if self._store is None:
            raise RuntimeError("kvstrata connector used after shutdown")
        return self._store

    def _count(self, name: str, n: int) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _write_stats(self) -> None:
        path = self.settings.stats_path
        if path is None:
            return
        os.makedirs(path, exist_ok=True)
        target = os.path.join(path, f"{self.role.name.lower()}-{os.getpid()}.json")
        tmp = target + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self._counters, f, sort_keys=True)
        os.replace(tmp, target)

    # ==============================  worker side  ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember vLLM's paged KV tensors; check that their blocks match the store layout."""
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kvstrata: KV caches for layers {missing} were not registered")
        paged = PagedKVBlocks(
            [kv_caches[n] for n in self._layer_names], self._num_blocks, self._block_size
        )
        if paged.layout != self.store_config.layout:
            raise ConfigError(
                f"kvstrata: vLLM's blocks hold {paged.layer_block_bytes} bytes per layer; the "
                f"KV cache spec promised {self.store_config.block_bytes // len(self._layer_names)}"
            )
        self._paged = paged

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's store hits into vLLM's blocks (synchronously, before the forward)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierConnectorMetadata)
        if not meta.plan.loads:
            return
        paged = self._require_paged()
        for load in meta.plan.loads:
            n = len(load.block_ids)
            staging = paged.staging(n)
            result = self.store.retrieve_into(
                load.token_ids, list(staging), first_block=load.first_block, extra_keys=load.extra_keys
            )
            paged.scatter(staging, load.block_ids[: result.num_blocks])
            for tier, count in result.blocks_per_tier.items():
                self._count(f"load_tokens_{tier.value}", count * self._block_size)
            if result.num_blocks < n:  # evicted since the lookup: vLLM recomputes these
                self._load_errors.update(load.block_ids[result.num_blocks :])
                self._count("load_error_blocks", n - result.num_blocks)
        self._write_stats()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` finished every layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: whole blocks are saved in `wait_for_save`, after the forward."""

    def wait_for_save(self) -> None:
        """Copy this step's newly completed full blocks out of vLLM into the store."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierConnectorMetadata)
        if not meta.plan.saves:
            return
        paged = self._require_paged()
        for save in meta.plan.saves:
            staging = paged.staging(len(save.block_ids))
            paged.gather(save.block_ids, staging)
            try:
                written = self.store.store_blocks(
                    save.token_ids, list(staging), first_block=save.first_block,
                    extra_keys=save.extra_keys,
                )
            except DiskFullError as exc:  # a cache: a refused write is a later miss
                logger.warning("kvstrata: save refused: %s", exc)
                self._count("save_refused_blocks", len(save.block_ids))
                continue
            self._count("save_blocks", len(save.block_ids))
            self._count("save_new_blocks", written)
        self._write_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _require_paged(self) -> PagedKVBlocks:
        if self._paged is None:
            raise RuntimeError("kvstrata: transfer before register_kv_caches (a bug)")
        return self._paged

    def shutdown(self) -> None:
        """Release the store (the last user in this process flushes and closes it)."""
        if self._store is not None and self._store_key is not None:
            self._write_stats()
            release_store(self._store_key)
            self._store = None

    # ==============================  scheduler side  ==============================
    def _lookup(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> int:
        return self.store.lookup(token_ids, extra_keys=extra_keys)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens kvstrata holds beyond vLLM's own `num_computed_tokens`, under the request's
        extra keys (salt, LoRA, multimodal inputs); loaded synchronously. A request that
        cannot be keyed safely is a miss and is never saved."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        keys = request_keys(request, self._block_size, generate_block_hash_extra_keys)
        if not keys.cacheable:
            self._count("unkeyable_requests", 1)
            logger.debug("kvstrata: request %s not cached: %s", request.request_id, keys.refusal)
        skip = getattr(request, "get_skip_reading_prefix_cache", None)
        may_load = not (skip() if callable(skip) else False)
        n = self._planner.num_new_matched_tokens(
            request.request_id, request.all_token_ids, num_computed_tokens, keys.extra_keys,
            cacheable=keys.cacheable, may_load=may_load,
        )
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._planner.on_alloc(request.request_id, request.all_token_ids, num_external_tokens)
        if num_external_tokens:
            self._count("hit_tokens", num_external_tokens)
            self._count("hit_requests", 1)
        self._count("lookups", 1)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Plan this step's loads and saves; forget preempted requests."""
        for req_id in scheduler_output.preempted_req_ids or ():
            self._planner.forget(req_id)
        scheduled: list[tuple[str, int, int]] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for new in scheduler_output.scheduled_new_reqs:
            num_new = scheduler_output.num_scheduled_tokens[new.req_id]
            scheduled.append(
                (new.req_id, new.num_computed_tokens, num_new - len(spec.get(new.req_id, ())))
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            num_new = scheduler_output.num_scheduled_tokens[req_id]
            scheduled.append(
                (req_id, cached.num_computed_tokens[i], num_new - len(spec.get(req_id, ())))
            )
        state = scheduler_output.kv_connector_block_state

        def block_ids_of(req_id: str) -> list[int]:
            ids = state.get_block_ids(req_id) if state is not None else None
            return list(ids[0]) if ids else []

        plan = self._planner.build(scheduled, block_ids_of)
        if plan.loads or plan.saves:
            self._write_stats()
        return TierConnectorMetadata(plan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous, so vLLM may free the blocks at once."""
        self._planner.forget(request.request_id)
        return False, None
