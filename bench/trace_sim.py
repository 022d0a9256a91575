"""The policy replay: a trace through tiers of block ids run by the shipped policy classes.

A `SimTier` is the CPU tier without its bytes: the same `tiers.cpu.residency.Residency` (hence the
same eviction policies, prefix links, quotas and use epochs), the same sequence of calls on a
put (touch the held blocks, split off what can never fit, take victims, send down what the
demotion admission admits, add, touch again, end the epoch) and on a read. `serve` replays
one request the way `KVCacheStore.retrieve` then `store` drive a tier stack: locate the
longest cached prefix across the tiers, read it tier by tier, promote the lower hits into the
top tier, then put the whole request into the top tier (and into the tiers written through).
`tests/bench/test_trace_policies.py` checks that a real store and this replay count the same hits.

`belady_hit_blocks` is the offline optimum for the same model (see its docstring).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from tiers.cpu.residency import Residency
from tiers.policies.admission import Admission, AdmissionSpec, parse_admission
from tiers.policies.eviction import EvictionKind
from tiers.policies.quota import NO_TENANT


def plan_ids(ids: Sequence[int], held: Residency[int], room: int) -> tuple[list[int], list[int]]:
    """`tiers.base.plan_put` over block ids: (overflow, fit) indices of the blocks not held,
    the last of duplicates winning, `fit` at most the `room` least evictable of them."""
    seen: set[int] = set()
    new: list[int] = []
    for i in range(len(ids) - 1, -1, -1):
        b = ids[i]
        if b not in seen and b not in held:
            seen.add(b)
            new.append(i)
    new.reverse()
    cut = max(0, len(new) - max(0, room))
    return new[:cut], new[cut:]


class SimTier:
    """One simulated tier of `capacity_blocks` blocks (see the module docstring)."""

    def __init__(self, capacity_blocks: int, eviction: EvictionKind | str = EvictionKind.LRU, *,
                 demote_admission: AdmissionSpec | str = "all", quota_blocks: int | None = None,
                 below: SimTier | None = None, parents: dict[int, int | None] | None = None,
                 keep_prefixes: bool = True) -> None:
        self.capacity_blocks = capacity_blocks
        self.res: Residency[int] = Residency(capacity_blocks, eviction, quota_blocks=quota_blocks,
                                             keep_prefixes=keep_prefixes)
        self.admission = Admission(parse_admission(demote_admission), max(1024, 4 * capacity_blocks))
        if self.admission.sketch is not None:
            self.res.on_use.append(self.admission.sketch)
        # block id -> parent id, as keys would carry it (None: keys carry no parents, as today)
        self.parent: dict[int, int | None] = {} if parents is None else parents
        self.below = below
        self.num_hits = 0
        self.num_puts = 0  # blocks written into this tier
        self.num_evictions = 0

    def holds(self, block: int) -> bool:
        return block in self.res

    def match_prefix(self, ids: Sequence[int], start: int) -> int:
        n, res = start, self.res
        while n < len(ids) and ids[n] in res:
            n += 1
        return n - start

    def get(self, ids: Sequence[int]) -> None:
        """`Tier.get_into` of held blocks (prefix order): hits, then touched tail first."""
        self.num_hits += len(ids)
        self.res.count_hits(ids)
        self.res.touch(ids[::-1])

    def put(self, ids: Sequence[int], tenant: bytes = NO_TENANT) -> int:
        """`CPUTier._put` of blocks in eviction order; returns how many were written."""
        res = self.res
        res.touch(ids)
        room = self.capacity_blocks - len(res) + res.num_evictable
        overflow, new = plan_ids(ids, res, room)
        if overflow:
            self._send_down([ids[i] for i in overflow], [tenant] * len(overflow))
        if new:
            need = len(new) - (self.capacity_blocks - len(res))
            if need > 0:
                victims = res.take_victims(need, tenant)
                self._send_down(victims, [res.tenant_of(v) for v in victims])
                res.commit(victims)
                self.num_evictions += len(victims)
            added = [ids[i] for i in new]
            parent = self.parent
            res.add_many(added, [parent.get(b) for b in added] if parent else None, [tenant] * len(added))
            res.touch(ids[new[-1] + 1:])
        res.end_put()
        self.num_puts += len(new)
        return len(new)

    def _send_down(self, ids: list[int], tenants: list[bytes]) -> None:
        """Demote what the admission admits (eviction order), one put per run of a tenant."""
        below = self.below
        if below is None:
            return
        admission = self.admission
        if not admission.admits_all:
            ok = [i for i, b in enumerate(ids) if admission.admit(b)]
            ids, tenants = [ids[i] for i in ok], [tenants[i] for i in ok]
        start = 0
        while start < len(ids):
            end = start + 1
            while end < len(ids) and tenants[end] == tenants[start]:
                end += 1
            below.put(ids[start:end], tenants[start])
            start = end


@dataclass
class Stack:
    """Simulated tiers, fastest first; `through` are written with every put (the remote tier),
    all of each put, or with `admit_through` only what the top tier's demotion admission
    admits (what the tier stack would do with admission on its write-through path)."""

    tiers: list[SimTier]
    through: list[SimTier]
    admit_through: bool = False

    def serve(self, ids: Sequence[int], tenant: bytes = NO_TENANT) -> int:
        """Replay one request; return how many of its leading blocks hit (in any tier)."""
        tiers = self.tiers
        top = tiers[0]
        plan = self._locate(ids)
        start = 0
        while start < len(plan):
            end = start
            while end < len(plan) and plan[end] == plan[start]:
                end += 1
            tiers[plan[start]].get(ids[start:end])
            start = end
        num_hit = len(plan)
        # promote: lower-tier hits into the top tier (tail first), within its capacity
        budget = top.capacity_blocks - sum(1 for i in range(num_hit) if plan[i] == 0)
        lower = [i for i in range(num_hit) if plan[i] != 0][: max(0, budget)]
        if lower:
            top.put([ids[i] for i in reversed(lower)], tenant)
        top.res.touch(ids[:num_hit][::-1])
        # store: the whole request into the top tier, tail first, and into the tiers written through
        tail_first = list(ids[::-1])
        top.put(tail_first, tenant)
        if self.through:
            if self.admit_through and not top.admission.admits_all:
                tail_first = [b for b in tail_first if top.admission.admit(b)]
            for tier in self.through:
                tier.put(tail_first, tenant)
        return num_hit

    def _locate(self, ids: Sequence[int]) -> list[int]:
        plan: list[int] = []
        tiers = self.tiers
        for block in ids:
            for index, tier in enumerate(tiers):
                if block in tier.res:
                    plan.append(index)
                    break
            else:
                break
        return plan


def parents_of(requests: Sequence[Sequence[int]]) -> dict[int, int | None]:
    """Each block id's parent (the id before it in its requests; None for a first block).
    In the Mooncake traces every id has one parent: equal ids are equal prefixes."""
    out: dict[int, int | None] = {}
    for ids in requests:
        prev = None
        for block in ids:
            out.setdefault(block, prev)
            prev = block
    return out


def belady_hit_blocks(requests: Sequence[Sequence[int]], capacity_blocks: int) -> int:
    """The offline optimum's block prefix hits over the whole trace (`belady_hits`)."""
    return sum(belady_hits(requests, capacity_blocks))


def belady_hits(requests: Sequence[Sequence[int]], capacity_blocks: int) -> list[int]:
    """Block hits of each request under the offline optimum: a cache of `capacity_blocks` that may refuse a block
    (bypass) and evicts the block whose next use is furthest in the future (Belady's MIN).

    Model: each request reads its longest cached prefix (its hits), then every one of its
    blocks is referenced in prefix order, one reference at a time. Next uses come from the
    whole trace. A parent is referenced whenever its child is, and earlier in each request, so
    its next use is always before its child's: MIN never evicts a prefix before its held
    children, the cache stays prefix-closed, and its plain hits are prefix hits. Since MIN
    (with bypass) maximises plain hits and no policy's prefix hits exceed its plain hits, this
    is exactly the most block prefix hits any cache of that size can get on the trace.
    """
    flat = [b for ids in requests for b in ids]
    never = len(flat) + 1
    next_use = [0] * len(flat)
    seen: dict[int, int] = {}
    for t in range(len(flat) - 1, -1, -1):
        next_use[t] = seen.get(flat[t], never)
        seen[flat[t]] = t
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits: list[int] = []
    t = 0
    for ids in requests:
        hit = 0
        for block in ids:
            if block not in cache:
                break
            hit += 1
        hits.append(hit)
        for block in ids:
            nxt = next_use[t]
            t += 1
            if block not in cache and len(cache) >= capacity_blocks:
                while cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if -heap[0][0] <= nxt:
                    continue  # the block itself is used furthest away: bypass it
                del cache[heapq.heappop(heap)[1]]
            cache[block] = nxt
            heapq.heappush(heap, (-nxt, block))
    return hits
