"""The worker role over several KV cache groups: one `ConnectorWorker` per group this worker
holds (each with its own store and paged tensors), a step's plan split between them.

A request's background load or delayed free is reported to vLLM once every group's worker has
reported it. A load that left blocks unloaded is reported, for a model with one KV cache
group, as vLLM block ids to recompute; with several, vLLM cannot map block ids back to
requests, so the request is reported as a failed load instead (vLLM recomputes it whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine_adapter.vllm.policy_rates import WorkerRates
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.store_config import GroupStore
from engine_adapter.vllm.transfer_plan import StepPlan
from engine_adapter.vllm.worker_side import ConnectorWorker
from kvstore import KVCacheStore


class GroupStats:
    """A group's view of the connector's counters: names prefixed with `group<g>_` (the
    primary group counts under the plain names)."""

    def __init__(self, stats: ConnectorStats, prefix: str) -> None:
        self._stats, self._prefix = stats, prefix

    def count(self, name: str, n: int) -> None:
        self._stats.count(self._prefix + name, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stats, name)


class _Tally:
    """Counts reports per request; a request is done once `needed` reports arrived."""

    def __init__(self, needed: int) -> None:
        self.needed = needed
        self._seen: dict[str, int] = {}

    def add(self, req_ids: set[str] | None, done: set[str]) -> None:
        for r in req_ids or ():
            count = self._seen.get(r, 0) + 1
            if count >= self.needed:
                self._seen.pop(r, None)
                done.add(r)
            else:
                self._seen[r] = count


class GroupedWorker:
    """Copies each step's planned blocks for every group this worker holds."""

    def __init__(self, stores: Sequence[tuple[GroupStore, KVCacheStore]], primary: int, num_blocks: int,
                 stats: ConnectorStats, *, async_saves: bool = True, fail_whole_requests: bool = False,
                 verify_tolerance: float = 0.0) -> None:
        self.parts: list[tuple[int, bool, ConnectorWorker]] = []  # (group, writer, worker)
        self.primary = primary
        for spec, store in stores:
            group_stats = stats if spec.group == primary else GroupStats(stats, f"group{spec.group}_")
            worker = ConnectorWorker(store, spec.config, list(spec.layer_names), num_blocks,
                                     group_stats,  # type: ignore[arg-type]  # duck-typed counters
                                     async_saves=async_saves, verify_tolerance=verify_tolerance)
            self.parts.append((spec.group, spec.writer, worker))
        stats.count("kv_cache_groups", len(self.parts))  # this worker's, once
        self.fail_whole_requests = fail_whole_requests
        self._sending, self._recving = _Tally(len(self.parts)), _Tally(len(self.parts))
        self._failed: set[str] = set()  # failed loads not yet reported finished

    @property
    def workers(self) -> list[ConnectorWorker]:
        return [w for _, _, w in self.parts]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for worker in self.workers:
            worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM frees its KV memory (sleep): every group's worker drops its views of it."""
        for worker in self.workers:
            worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM's KV memory is back (wake-up): every group's worker rebuilds its views."""
        for worker in self.workers:
            worker.restore_kv_caches()

    @staticmethod
    def _part(plan: StepPlan, group: int, writer: bool) -> StepPlan:
        """This group's share of `plan`. Every group gets every background load (an empty
        one too), so that each reports its end."""
        return StepPlan(
            loads=[t.group(group) for t in plan.loads if t.groups[group].block_ids],
            saves=[t.group(group) for t in plan.saves if t.groups[group].block_ids] if writer else [],
            finished=plan.finished,
            async_loads=[t.group(group) for t in plan.async_loads],
            delayed_frees=plan.delayed_frees,
            num_prefill_tokens=plan.num_prefill_tokens,
        )

    def load(self, plan: StepPlan) -> None:
        for group, writer, worker in self.parts:
            worker.load(self._part(plan, group, writer))

    def save(self, plan: StepPlan) -> None:
        for group, writer, worker in self.parts:
            worker.save(self._part(plan, group, writer))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(delayed frees every group's worker released, background loads every group ended)."""
        sending: set[str] = set()
        recving: set[str] = set()
        for worker in self.workers:
            s, r = worker.get_finished(finished_req_ids)
            self._sending.add(s, sending)
            self._recving.add(r, recving)
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        """vLLM block ids to recompute (one KV cache group only; see `take_failed_loads`)."""
        errors: set[int] = set()
        for worker in self.workers:
            errors |= worker.take_load_errors()
        return set() if self.fail_whole_requests else errors

    def take_failed_loads(self, finished: set[str] | None) -> set[str]:
        """With several KV cache groups: the requests among `finished` (background loads just
        reported ended) whose load failed in some group."""
        for worker in self.workers:
            self._failed |= worker.take_failed_loads()
        if not self.fail_whole_requests:
            self._failed.clear()  # reported as block ids instead
            return set()
        failed = self._failed & (finished or set())
        self._failed -= failed
        return failed

    def step_begins(self) -> None:
        """vLLM runs the forward pass next: every group's load policy starts timing it."""
        for worker in self.workers:
            worker.step_begins()

    def forward_ended(self) -> None:
        """vLLM's forward pass of this step has ended."""
        for worker in self.workers:
            worker.forward_ended()

    def rates(self, pp_rank: int, tp_rank: int) -> WorkerRates:
        """The load-policy estimates of the primary group's store (the one the scheduler's policy
        decides with), or of the first group this worker holds."""
        worker = next((w for g, _, w in self.parts if g == self.primary), self.parts[0][2])
        return worker.rates(pp_rank, tp_rank)

    def flush(self) -> None:
        for worker in self.workers:
            worker.flush()
