"""The connector's scheduler role: lookups under each request's keys, and per-step plans of
which blocks the worker loads (before the forward pass) and saves (after it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine_adapter.vllm.keys import request_keys
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.transfer_plan import StepPlan, TransferPlanner
from engine_adapter.vllm.worker_side import PENDING
from kvstore import ExtraKeys, KVCacheStore

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class ConnectorScheduler:
    """Decides, for each request and step, what the worker copies; holds no KV."""

    def __init__(self, store: KVCacheStore, block_size: int, stats: ConnectorStats, *,
                 async_saves: bool = True) -> None:
        self.store = store
        self.async_saves = async_saves
        self.block_size = block_size
        self.stats = stats
        self.planner = TransferPlanner(block_size, self._lookup)
        self._finished: list[str] = []  # told to the worker with the next plan
        # Requests whose prefix was prefetched from disk/remote into the CPU tier when first seen
        # waiting (only where this process's store has a CPU tier: vLLM's single-process mode).
        self._prefetch = any(t.kind.value == "cpu" for t in store.tiers) and any(
            t.kind.value in ("disk", "remote") for t in store.tiers)
        self._prefetched: set[str] = set()

    def _lookup(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> int:
        hit = self.store.lookup(token_ids, extra_keys=extra_keys)
        if self.async_saves and hit + self.block_size <= len(token_ids) and PENDING.any(self.store):
            # The next block may be on its way to the store (saved by this process's worker,
            # queued in the background): wait for that write, then look again.
            nxt = self.store.block_hashes(token_ids[: hit + self.block_size], extra_keys)[-1]
            if PENDING.wait_for(self.store, nxt):
                hit = self.store.lookup(token_ids, extra_keys=extra_keys)
        return hit

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvstrata holds beyond vLLM's own `num_computed_tokens`, under the request's
        extra keys (salt, LoRA, multimodal inputs); loaded synchronously. A request that
        cannot be keyed safely is a miss and is never saved."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        keys = request_keys(request, self.block_size, generate_block_hash_extra_keys)
        if not keys.cacheable:
            self.stats.count("unkeyable_requests", 1)
            logger.debug("kvstrata: request %s not cached: %s", request.request_id, keys.refusal)
        skip = getattr(request, "get_skip_reading_prefix_cache", None)
        may_load = not (skip() if callable(skip) else False)
        if self._prefetch and keys.cacheable and may_load and request.request_id not in self._prefetched:
            self._prefetched.add(request.request_id)
            self.store.prefetch(request.all_token_ids, extra_keys=keys.extra_keys)  # runs in the background
        n = self.planner.num_new_matched_tokens(
            request.request_id, request.all_token_ids, num_computed_tokens, keys.extra_keys,
            cacheable=keys.cacheable, may_load=may_load,
        )
        return n, False

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self.planner.on_alloc(request.request_id, request.all_token_ids, num_external_tokens)
        if num_external_tokens:
            self.stats.count("hit_tokens", num_external_tokens)
            self.stats.count("hit_requests", 1)
        self.stats.count("lookups", 1)

    def build_plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """Plan this step's loads and saves; forget preempted requests."""
        for req_id in scheduler_output.preempted_req_ids or ():
            self.planner.forget(req_id)
        scheduled: list[tuple[str, int, int]] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for new in scheduler_output.scheduled_new_reqs:
            num_new = scheduler_output.num_scheduled_tokens[new.req_id]
            scheduled.append((new.req_id, new.num_computed_tokens, num_new - len(spec.get(new.req_id, ()))))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            num_new = scheduler_output.num_scheduled_tokens[req_id]
            scheduled.append((req_id, cached.num_computed_tokens[i], num_new - len(spec.get(req_id, ()))))
        state = scheduler_output.kv_connector_block_state

        def block_ids_of(req_id: str) -> list[int]:
            ids = state.get_block_ids(req_id) if state is not None else None
            return list(ids[0]) if ids else []

        plan = self.planner.build(scheduled, block_ids_of)
        plan.finished, self._finished = self._finished, []
        for kind, blocks in self.store.prefetched_blocks.items():  # by source tier, so far
            self.stats.counters[f"prefetch_tokens_{kind.value}"] = blocks * self.block_size
        if plan.loads or plan.saves:
            self.stats.write()
        return plan

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM may free the request's blocks at once: every save copied its blocks out of vLLM
        during the step that planned it (asynchronous saves only write those copies later)."""
        self.planner.forget(request.request_id)
        self._prefetched.discard(request.request_id)
        self._finished.append(request.request_id)
        return False, None
