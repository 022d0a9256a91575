"""The connector's scheduler role: lookups under each request's keys, and per-step plans of
which blocks the worker loads (before the forward pass) and saves (after it)."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine_adapter.vllm.group_lookup import GroupLookup
from engine_adapter.vllm.groups import GroupKind, GroupRule
from engine_adapter.vllm.handoff import KEY, HandoffWaits, offer, promised
from engine_adapter.vllm.hints import NONE, Hints, parse
from engine_adapter.vllm.keys import AdapterKeys, request_keys
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.transfer_plan import BlockTransfer, StepPlan, TransferPlanner
from kvstore import ExtraKeys, KVCacheStore
from kvstore.hashing import BlockChain
from tiers.keys import TierKind
from tiers.shared.ratelimit import RateLimitedWarning

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class ConnectorScheduler:
    """Decides, for each request and step, what the worker copies; holds no KV.

    `store` is the primary group's store (its load policy decides what is worth loading);
    `lookup` finds hits across every group and shard (default: `store` alone, one full
    attention group). With `async_only`, every load runs in the background, where vLLM can
    be told of a failed one (with several KV cache groups it cannot take failed block ids).
    `loads` / `saves` off (vLLM's `kv_role`: a `kv_producer` never loads, a `kv_consumer`
    never saves): no lookup is made, no save planned.
    """

    def __init__(self, store: KVCacheStore, block_size: int, stats: ConnectorStats, *,
                 async_saves: bool = True, async_loads: bool = True, lookup: GroupLookup | None = None,
                 async_only: bool = False, loads: bool = True, saves: bool = True,
                 verify_fraction: float = 0.0) -> None:
        self.store = store
        self.verify_fraction = verify_fraction
        self._sample = random.Random()  # which hits are verified (not a secret: any stream does)
        self.loads, self.saves = loads, saves
        self.handoffs = HandoffWaits()  # consumers: requests waiting for a producer's blocks
        self._hints: dict[str, Hints] = {}  # per request until it finishes (`hints.py`)
        self._warn_hints = RateLimitedWarning(logger)
        self.lookup = lookup or GroupLookup([GroupRule(GroupKind.FULL, block_size)], [[store]], 0)
        self.async_only = async_only
        self.async_saves = async_saves
        self.async_loads = async_loads
        self._async_wanted: set[str] = set()  # told vLLM "asynchronous" for these lookups
        self._async_loads: list[BlockTransfer] = []  # to send with the next plan
        self._loading: set[str] = set()  # their loads were sent; not yet known finished
        self._delayed: list[str] = []  # finished while loading: freed once the worker says so
        self.block_size = block_size
        self.stats = stats
        self._adapters = AdapterKeys()  # LoRA adapters as this engine loaded them
        self.planner = TransferPlanner(block_size, self.hit_tokens, self.lookup.rules)
        self._finished: list[str] = []  # told to the worker with the next plan
        # Tiers whose hits load from memory (synchronously, in the step): every other is slow.
        self._memory_kinds = frozenset(t.kind for s in self.lookup.every_store for t in s.tiers if t.traits.memory)
        # Requests whose prefix was prefetched from slow tiers (disk, remote) into a memory tier
        # below the pool when first seen waiting (only where this process's store has one: vLLM's
        # single-process mode).
        self._prefetch = len(self.lookup.every_store) == 1 and any(
            t.traits.memory and not t.traits.engine_memory for t in store.tiers) and any(
            not t.traits.memory for t in store.tiers)
        self._prefetched: set[str] = set()
        self._kinds: list[TierKind] = []  # the tier of each block of the last lookup
        self._chain: BlockChain | None = None  # the keys the last lookup hashed in `store`

    def hit_tokens(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> int:
        """The planner's lookup: the prefix every group and shard holds (waiting first for
        blocks this process's worker still has queued), cut by the load policy to the leading
        blocks worth loading (at the rates the workers measured: shared in this process, or
        reported through vLLM from theirs; until then, all of them) and back to a length
        every group can serve. Keeps each block's
        tier for `get_num_new_matched_tokens`."""
        self._kinds = self.lookup.locate(token_ids, extra_keys)
        self._chain = self.lookup.primary_chain
        return self.lookup.cut(self.store.load_policy.blocks_to_load(self._kinds)) * self.block_size

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvstrata holds (and the load policy says to load) beyond vLLM's own
        `num_computed_tokens`, under the request's extra keys (salt, LoRA, multimodal inputs),
        and whether they load in the background (a disk or remote hit, with `async_loads`). A
        request that cannot be keyed safely is a miss and is never saved."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        keys = request_keys(request, self.block_size, generate_block_hash_extra_keys, self._adapters)
        if not keys.cacheable:
            self.stats.count("unkeyable_requests", 1)
            logger.debug("kvstrata: request %s not cached: %s", request.request_id, keys.refusal)
        hints = self._hints_of(request)
        skip = getattr(request, "get_skip_reading_prefix_cache", None)
        may_load = self.loads and hints.load and not (skip() if callable(skip) else False)
        self._kinds, self._chain = [], None
        n = self.planner.num_new_matched_tokens(
            request.request_id, request.all_token_ids, num_computed_tokens, keys.extra_keys,
            cacheable=keys.cacheable, may_load=may_load, may_save=hints.store, retain_s=hints.retain_s,
            priority=hints.priority,
        )
        if may_load and keys.cacheable and self._waits_for_handoff(request, num_computed_tokens):
            self.planner.forget(request.request_id)
            return None, False
        if n > 0 and hints.store and (hints.verify or self._sample.random() < self.verify_fraction):
            self.planner.verify(request.request_id)  # computed instead, then compared with the tiers
            self.stats.count("verify_requests", 1)
            return 0, False
        # Blocks to load from disk or a remote tier: vLLM waits for them outside its steps.
        to_load = self._kinds[num_computed_tokens // self.block_size : (num_computed_tokens + n) // self.block_size]
        slow = n > 0 and (self.async_only or (self.async_loads and any(
            k not in self._memory_kinds for k in to_load)))
        if slow:
            self._async_wanted.add(request.request_id)
        else:
            self._async_wanted.discard(request.request_id)
            if self._prefetch and keys.cacheable and may_load and request.request_id not in self._prefetched:
                self._prefetched.add(request.request_id)
                # In the background, with the keys the lookup hashed (if it ran).
                self.store.prefetch(request.all_token_ids, extra_keys=keys.extra_keys, chain=self._chain)
        return n, slow

    def _hints_of(self, request: Request) -> Hints:
        """The request's hints (`hints.py`), checked once: bad ones counted and warned about."""
        hints = self._hints.get(request.request_id)
        if hints is None:
            hints = self._hints[request.request_id] = parse(getattr(request, "kv_transfer_params", None))
            if hints.accepted or hints.rejected:
                self.stats.count("hint_requests", 1)
            if hints.rejected:
                self.stats.count("hints_rejected", len(hints.rejected))
                self._warn_hints(f"request {request.request_id}: kvstrata hints rejected: {hints.rejected}")
        return hints

    def _waits_for_handoff(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether the request should be looked up again later: its `kv_transfer_params` promise
        blocks a producer saved that the stores do not all hold yet (`handoff.py`)."""
        want = promised(getattr(request, "kv_transfer_params", None))
        if want is None:
            return False
        if want < 0:
            self.stats.count("handoff_params_rejected", 1)
            logger.warning("kvstrata: request %s: malformed kv_transfer_params[%r] ignored", request.request_id,
                           "kvstrata")
            return False
        want = min(want, max(0, len(request.all_token_ids) - 1) // self.block_size)  # a hit leaves a token
        held = max(num_computed_tokens // self.block_size, len(self._kinds))  # held, before the load policy
        wait = self.handoffs.should_wait(request.request_id, held, want)
        if wait is None:
            self.stats.count("handoff_timeouts", 1)
        return bool(wait)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int,
                                 block_ids: Sequence[Sequence[int]] = ()) -> None:
        """Track the request vLLM allocated blocks for (`block_ids`: per KV cache group); a
        load that runs in the background starts with the next step."""
        self.planner.on_alloc(request.request_id, request.all_token_ids, num_external_tokens)
        if request.request_id in self._async_wanted:
            self._async_wanted.discard(request.request_id)
            load = self.planner.take_load(request.request_id, block_ids) if num_external_tokens else None
            if load is not None:  # vLLM waits for it (WAITING_FOR_REMOTE_KVS) until get_finished says so
                self._async_loads.append(load)
                self._loading.add(request.request_id)
                self.stats.count("async_load_requests", 1)
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

        num_groups = len(self.lookup.rules)

        def block_ids_of(req_id: str) -> list[list[int]]:
            ids = state.get_block_ids(req_id) if state is not None else None
            return [list(g) for g in ids] if ids else [[] for _ in range(num_groups)]

        plan = self.planner.build(scheduled, block_ids_of)
        if not self.saves:
            plan.saves = []
        plan.num_prefill_tokens = sum(n for _, _, n in scheduled if n > 1)
        plan.finished, self._finished = self._finished, []
        plan.async_loads, self._async_loads = self._async_loads, []
        plan.delayed_frees, self._delayed = self._delayed, []
        for new in scheduler_output.scheduled_new_reqs:  # scheduled: its background load is done
            self._loading.discard(new.req_id)
        for kind, blocks in self.store.prefetched_blocks.items():  # by source tier, so far
            self.stats.set(f"prefetch_tokens_{kind.value}", blocks * self.block_size)
        self.stats.write(if_changed=True)  # this step's lookups and decisions
        return plan

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM may free the request's blocks at once (every save copied its blocks out of vLLM
        during the step that planned it), unless a background load may still be writing into
        them: then True, and the worker reports the request when that load has ended. A
        `kv_producer` offers the prompt blocks it saved to a consumer (`handoff.py`)."""
        saved = self.planner.saved_blocks(request.request_id) if self.saves and not self.loads else 0
        params = offer(min(saved, max(0, request.num_prompt_tokens - 1) // self.block_size))
        report = self._hints.pop(request.request_id, NONE).report()
        if report is not None:  # the response says which hints applied
            params = params or {KEY: {}}
            params[KEY]["hints"] = report
        self.planner.forget(request.request_id)
        self.handoffs.forget(request.request_id)
        self._prefetched.discard(request.request_id)
        self._async_wanted.discard(request.request_id)
        self._finished.append(request.request_id)
        if request.request_id in self._loading:
            # Finished (aborted) while its background load may still write into its blocks:
            # the worker reports it (finished_sending) once that load has ended.
            self._loading.discard(request.request_id)
            self._delayed.append(request.request_id)
            return True, params
        self._loading.discard(request.request_id)
        return False, params

    def hit_kinds(self, num_computed_tokens: int, num_tokens: int) -> list[TierKind]:
        """The tier of each block of the hit the last `get_num_new_matched_tokens` returned
        (`num_tokens` beyond `num_computed_tokens`), as this process's store located them."""
        first = num_computed_tokens // self.block_size
        return self._kinds[first : first + -(-num_tokens // self.block_size)]
