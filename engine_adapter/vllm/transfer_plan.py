"""Scheduler-side bookkeeping of an engine connector: which blocks each request loads and saves.

Pure Python over token ids and engine block ids, so it runs (and is tested) without the
engine. Block `i` of a request covers tokens `[i * block_size, (i + 1) * block_size)` and
lives in engine block `block_ids[i]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore import ExtraKeys


@dataclass(frozen=True)
class BlockTransfer:
    """Copy blocks `first_block .. first_block + len(block_ids) - 1` of one request.

    `token_ids` (uint32) cover every block up to the last one copied, so the worker can
    compute the chained keys.
    """

    req_id: str
    token_ids: np.ndarray
    first_block: int
    block_ids: tuple[int, ...]
    extra_keys: ExtraKeys | None = None


@dataclass
class StepPlan:
    """The transfers of one engine step: loads run before the forward pass, saves after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # requests whose per-request state can go
    # Loads the worker runs in the background (the request waits for them outside the steps).
    async_loads: list[BlockTransfer] = field(default_factory=list)
    # Finished requests whose blocks vLLM frees only once the worker reports them (their
    # background load may still be writing into those blocks).
    delayed_frees: list[str] = field(default_factory=list)
    # Tokens this step prefills (chunks of more than one token): the worker times the forward
    # pass against them, for the load policy's prefill rate.
    num_prefill_tokens: int = 0


@dataclass
class _Request:
    token_ids: Sequence[int]  # a live view: grows as the request decodes
    num_saved_blocks: int  # leading blocks the store holds or a planned save will write
    load: tuple[int, int] | None  # block range to load in the next step
    extra_keys: ExtraKeys | None = None  # salt, adapter, multimodal inputs
    cacheable: bool = True  # False: nothing of it is saved (it cannot be keyed safely)


class TransferPlanner:
    """Tracks requests from lookup to finish and turns each scheduled step into a `StepPlan`.

    Invariant: a tracked request's blocks `[0, num_saved_blocks)` are either held by the store
    (as of its lookup) or part of a save already planned; each block is planned for saving at
    most once while tracked, and only once the step computing its last token is scheduled.
    """

    def __init__(self, block_size: int, lookup: Callable[[Sequence[int], ExtraKeys | None], int]) -> None:
        self.block_size = block_size
        self._lookup = lookup
        # req_id -> (local computed, store hit, extra keys, cacheable)
        self._pending: dict[str, tuple[int, int, ExtraKeys | None, bool]] = {}
        self._requests: dict[str, _Request] = {}

    def num_new_matched_tokens(
        self, req_id: str, token_ids: Sequence[int], num_computed: int,
        extra_keys: ExtraKeys | None = None, *, cacheable: bool = True, may_load: bool = True,
    ) -> int:
        """Tokens the store can add beyond the `num_computed` the engine already has.

        Looks up the longest cached prefix under `extra_keys` that leaves at least one token
        to compute (the engine needs it for logits). A request that is not `cacheable` is
        neither looked up nor later saved; one that may not load (it asked to skip reading
        prefix caches) is still saved. Records the lookup for `on_alloc`; calling again
        replaces it.
        """
        b = self.block_size
        limit = (len(token_ids) - 1) // b * b if token_ids else 0
        hit = 0
        if cacheable and may_load and limit > num_computed:
            hit = self._lookup(token_ids[:limit], extra_keys)
        self._pending[req_id] = (num_computed, hit, extra_keys, cacheable)
        return max(0, hit - num_computed)

    def on_alloc(self, req_id: str, token_ids: Sequence[int], num_external_tokens: int) -> None:
        """Start tracking a request the engine scheduled; plan its load if it has one."""
        b = self.block_size
        num_computed, hit, extra_keys, cacheable = self._pending.pop(req_id, (0, 0, None, True))
        load = None
        if num_external_tokens > 0:
            end = num_computed + num_external_tokens
            if num_computed % b or end % b or end > hit:
                raise RuntimeError(
                    f"request {req_id}: load of tokens [{num_computed}, {end}) is not the "
                    f"block-aligned store hit of {hit} tokens (a bug)"
                )
            load = (num_computed // b, end // b)
        self._requests[req_id] = _Request(token_ids, hit // b, load, extra_keys, cacheable)

    def take_load(self, req_id: str, block_ids: Sequence[int]) -> BlockTransfer | None:
        """The load `on_alloc` recorded for `req_id`, into `block_ids` (the request's engine
        blocks), to run now instead of with the request's first scheduled step; None if it
        has none."""
        state = self._requests.get(req_id)
        if state is None or state.load is None:
            return None
        first, end = state.load
        state.load = None
        tokens = np.asarray(state.token_ids[: end * self.block_size], dtype=np.uint32)
        return BlockTransfer(req_id, tokens, first, tuple(block_ids[first:end]), state.extra_keys)

    def forget(self, req_id: str) -> None:
        """Stop tracking a request (finished or preempted); unknown ids are ignored."""
        self._pending.pop(req_id, None)
        self._requests.pop(req_id, None)

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._requests

    def build(
        self,
        scheduled: Sequence[tuple[str, int, int]],
        block_ids_of: Callable[[str], Sequence[int]],
    ) -> StepPlan:
        """The plan for one step.

        Args:
            scheduled: `(req_id, num_computed_tokens, num_new_tokens)` per scheduled request,
                where the new tokens are those whose KV this step computes.
            block_ids_of: a request's engine block ids (all of them, in order).
        """
        b = self.block_size
        plan = StepPlan()
        for req_id, num_computed, num_new in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            block_ids = block_ids_of(req_id)
            if state.load is not None:
                first, end = state.load
                tokens = np.asarray(state.token_ids[: end * b], dtype=np.uint32)
                plan.loads.append(
                    BlockTransfer(req_id, tokens, first, tuple(block_ids[first:end]), state.extra_keys)
                )
                state.load = None
            if not state.cacheable:
                continue
            done = min((num_computed + num_new) // b, len(state.token_ids) // b, len(block_ids))
            if done > state.num_saved_blocks:
                first = state.num_saved_blocks
                tokens = np.asarray(state.token_ids[: done * b], dtype=np.uint32)
                plan.saves.append(
                    BlockTransfer(req_id, tokens, first, tuple(block_ids[first:done]), state.extra_keys)
                )
                state.num_saved_blocks = done
        return plan
