"""Scheduler-side bookkeeping of an engine connector: which blocks each request loads and saves.

Pure Python over token ids and engine block ids, so it runs (and is tested) without the
engine. Block `i` of a request covers tokens `[i * block_size, (i + 1) * block_size)` and
lives, in KV cache group `g`, in engine block `block_ids[g][i]`. Each group's `GroupRule`
says which of its blocks a hit needs: those are loaded, and after each step those a hit
ending there would need are saved (every block for full attention).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine_adapter.vllm.groups import GroupKind, GroupRule
from kvstore import ExtraKeys


@dataclass(frozen=True)
class GroupBlocks:
    """Blocks `first_block .. first_block + len(block_ids) - 1` of a request in one KV cache
    group, and the engine blocks they go to or come from."""

    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockTransfer:
    """Copy, in each KV cache group `g`, the blocks `groups[g]` names of one request.

    `token_ids` (uint32) cover every block up to the last one copied, so the worker can
    compute the chained keys.
    """

    req_id: str
    token_ids: np.ndarray
    groups: tuple[GroupBlocks, ...]
    extra_keys: ExtraKeys | None = None
    retain_s: float | None = None  # a save: keep its blocks this long (the request's `retain_s` hint)
    verify: bool = False  # a save of KV computed to verify: compare it with the tiers' copies first
    priority: str | None = None  # a save: its blocks' eviction priority (the request's `priority` hint)

    def _only(self) -> GroupBlocks:
        if len(self.groups) != 1:
            raise RuntimeError(f"transfer of {self.req_id} spans {len(self.groups)} KV cache groups (a bug)")
        return self.groups[0]

    @property
    def first_block(self) -> int:
        """The first block copied (a transfer of one group only)."""
        return self._only().first_block

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The engine blocks copied (a transfer of one group only)."""
        return self._only().block_ids

    def group(self, g: int) -> BlockTransfer:
        """The part of this transfer in group `g`, as a transfer of one group."""
        return dataclasses.replace(self, groups=(self.groups[g],))

    @property
    def num_blocks(self) -> int:
        return sum(len(g.block_ids) for g in self.groups)


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
    req_id: str
    token_ids: Sequence[int]  # a live view: grows as the request decodes
    num_saved_blocks: int  # leading blocks the store holds or a planned save will write
    load: tuple[int, int] | None  # block range to load in the next step
    extra_keys: ExtraKeys | None = None  # salt, adapter, multimodal inputs
    cacheable: bool = True  # False: nothing of it is saved (it cannot be keyed safely)
    repeat_hit: int = 0  # the longest hit, in blocks, a repeat of its prompt can take
    retain_s: float | None = None  # its saves are retained this long (a hint)
    verify: bool = False  # its hit was computed instead: its saves are compared with the tiers first
    priority: str | None = None  # its saves get this eviction priority (a hint)


def _keep(rule: GroupRule, block: int, block_id: int, *, hit_ends: tuple[int, ...], step_end: int) -> bool:
    """Whether a block is saved: some hit ending at one of `hit_ends` needs it."""
    return any(rule.savable(block, block_id, n, step_end) for n in hit_ends)


def _last_run(blocks: range, block_ids: Sequence[int], keep: Callable[[int, int], bool]) -> GroupBlocks | None:
    """The last run of consecutive `blocks` whose (block, engine block) `keep` accepts (the
    blocks a group keeps are consecutive, and vLLM drops its oldest first), or None."""
    end = min(blocks.stop, len(block_ids))
    while end > blocks.start and not keep(end - 1, block_ids[end - 1]):
        end -= 1
    first = end
    while first > blocks.start and keep(first - 1, block_ids[first - 1]):
        first -= 1
    if first == end:
        return None
    return GroupBlocks(first, tuple(block_ids[first:end]))


class TransferPlanner:
    """Tracks requests from lookup to finish and turns each scheduled step into a `StepPlan`.

    Invariant: a tracked request's blocks `[0, num_saved_blocks)` are either held by the store
    (as of its lookup) or were considered by a save already planned; each block is planned for
    saving at most once while tracked, and only once the step computing its last token is
    scheduled. `rules` (one per KV cache group; default one full-attention group) say which
    of a group's blocks are loaded and saved.
    """

    def __init__(self, block_size: int, lookup: Callable[[Sequence[int], ExtraKeys | None], int],
                 rules: Sequence[GroupRule] | None = None) -> None:
        self.block_size = block_size
        self.rules = list(rules) if rules is not None else [GroupRule(GroupKind.FULL, block_size)]
        self._lookup = lookup
        # req_id -> (local computed, store hit, extra keys, cacheable)
        self._pending: dict[str, tuple[int, int, ExtraKeys | None, bool, float | None, str | None]] = {}
        self._verify: set[str] = set()  # pending requests whose hit is computed and verified
        self._requests: dict[str, _Request] = {}

    def num_new_matched_tokens(
        self, req_id: str, token_ids: Sequence[int], num_computed: int,
        extra_keys: ExtraKeys | None = None, *, cacheable: bool = True, may_load: bool = True,
        may_save: bool = True, retain_s: float | None = None, priority: str | None = None,
    ) -> int:
        """Tokens the store can add beyond the `num_computed` the engine already has.

        Looks up the longest cached prefix under `extra_keys` that leaves at least one token
        to compute (the engine needs it for logits). A request that is not `cacheable` is
        neither looked up nor later saved; one that may not load (it asked to skip reading
        prefix caches) is still saved; one that may not save (a `store: false` hint) still
        loads. Its saves are retained for `retain_s` and given `priority` (hints). Records the lookup for
        `on_alloc`; calling again replaces it.
        """
        b = self.block_size
        limit = (len(token_ids) - 1) // b * b if token_ids else 0
        hit = 0
        if cacheable and may_load and limit > num_computed:
            hit = self._lookup(token_ids[:limit], extra_keys)
        self._pending[req_id] = (num_computed, hit, extra_keys, cacheable and may_save, retain_s, priority)
        return max(0, hit - num_computed)

    def verify(self, req_id: str) -> None:
        """The pending request's hit is not loaded but computed, and its saves, from the
        blocks vLLM did not have, are compared with the tiers' copies (verify mode)."""
        pending = self._pending.get(req_id)
        if pending is not None:
            num_computed, _, extra_keys, cacheable, retain_s, priority = pending
            self._pending[req_id] = (num_computed, num_computed, extra_keys, cacheable, retain_s, priority)
            self._verify.add(req_id)

    def on_alloc(self, req_id: str, token_ids: Sequence[int], num_external_tokens: int) -> None:
        """Start tracking a request the engine scheduled; plan its load if it has one.

        vLLM calls again, without a new lookup, once a background load has ended: the request
        keeps its state (its keys above all). A request never looked up is never saved (its
        keys are unknown)."""
        b = self.block_size
        pending = self._pending.pop(req_id, None)
        if pending is None:
            if req_id in self._requests and num_external_tokens == 0:
                return
            pending = (0, 0, None, False, None, None)
        num_computed, hit, extra_keys, cacheable, retain_s, priority = pending
        load = None
        if num_external_tokens > 0:
            end = num_computed + num_external_tokens
            if num_computed % b or end % b or end > hit:
                raise RuntimeError(
                    f"request {req_id}: load of tokens [{num_computed}, {end}) is not the "
                    f"block-aligned store hit of {hit} tokens (a bug)"
                )
            load = (num_computed // b, end // b)
        self._requests[req_id] = _Request(req_id, token_ids, hit // b, load, extra_keys, cacheable,
                                          repeat_hit=max(0, len(token_ids) - 1) // b, retain_s=retain_s,
                                          verify=req_id in self._verify, priority=priority)
        self._verify.discard(req_id)

    def take_load(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> BlockTransfer | None:
        """The load `on_alloc` recorded for `req_id`, into `block_ids` (the request's engine
        blocks, per group), to run now instead of with the request's first scheduled step;
        None if it has none."""
        state = self._requests.get(req_id)
        if state is None or state.load is None:
            return None
        load = self._load(state, block_ids)
        state.load = None
        return load

    def _load(self, state: _Request, block_ids: Sequence[Sequence[int]]) -> BlockTransfer:
        """The blocks of `state.load` each group needs, from the first block not computed yet."""
        assert state.load is not None
        first, end = state.load
        return self._transfer(state, block_ids, end,
                              lambda rule: (range(max(first, rule.needed(end).start), end), rule.loadable))

    def forget(self, req_id: str) -> None:
        """Stop tracking a request (finished or preempted); unknown ids are ignored."""
        self._pending.pop(req_id, None)
        self._verify.discard(req_id)
        self._requests.pop(req_id, None)

    def saved_blocks(self, req_id: str) -> int:
        """The leading blocks of a tracked request the store holds or a planned save writes (0
        for an untracked one)."""
        state = self._requests.get(req_id)
        return state.num_saved_blocks if state is not None else 0

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._requests

    def build(
        self,
        scheduled: Sequence[tuple[str, int, int]],
        block_ids_of: Callable[[str], Sequence[Sequence[int]]],
    ) -> StepPlan:
        """The plan for one step.

        Args:
            scheduled: `(req_id, num_computed_tokens, num_new_tokens)` per scheduled request,
                where the new tokens are those whose KV this step computes.
            block_ids_of: a request's engine block ids per group (all of them, in order).
        """
        b = self.block_size
        plan = StepPlan()
        for req_id, num_computed, num_new in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            block_ids = block_ids_of(req_id)
            if state.load is not None:
                plan.loads.append(self._load(state, block_ids))
                state.load = None
            if not state.cacheable:
                continue
            step_end = num_computed + num_new
            done = min(step_end // b, len(state.token_ids) // b, *(len(ids) for ids in block_ids))
            if done > state.num_saved_blocks:
                save = self._save(state, block_ids, done, step_end)
                if save.num_blocks:
                    plan.saves.append(save)
                state.num_saved_blocks = done
        return plan

    def _save(self, state: _Request, block_ids: Sequence[Sequence[int]], done: int, step_end: int) -> BlockTransfer:
        """The blocks in `[num_saved_blocks, done)` each group's rule keeps after this step:
        those a hit of `done` blocks needs (a longer request continuing this one), and those
        the longest hit of a repeat of the prompt needs (one block shorter when the prompt
        fills its last block: a hit leaves one token to compute)."""
        hit_ends = (done, min(done, state.repeat_hit))
        save = self._transfer(state, block_ids, done, lambda rule: (
            range(state.num_saved_blocks, done), functools.partial(_keep, rule, hit_ends=hit_ends, step_end=step_end)))
        if state.retain_s is None and not state.verify and state.priority is None:
            return save
        return dataclasses.replace(save, retain_s=state.retain_s, verify=state.verify, priority=state.priority)

    def _transfer(self, state: _Request, block_ids: Sequence[Sequence[int]], end: int,
                  wanted: Callable[[GroupRule], tuple[range, Callable[[int, int], bool]]]) -> BlockTransfer:
        """The one place a transfer is built: `state`'s tokens up to block `end` and, in each
        group, the last run of the blocks `wanted(rule)` names that its test keeps (none: an
        empty run at `end`)."""
        groups = []
        for rule, ids in zip(self.rules, block_ids, strict=True):
            blocks, keep = wanted(rule)
            groups.append(_last_run(blocks, ids, keep) or GroupBlocks(end, ()))
        tokens = np.asarray(state.token_ids[: end * self.block_size], dtype=np.uint32)
        return BlockTransfer(state.req_id, tokens, tuple(groups), state.extra_keys)
