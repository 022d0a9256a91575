"""Retention: a caller's hint that a prefix will come back (a session's context after a tool
call), kept through eviction pressure for a while, within a budget per tenant.

`retain` pins the given blocks in the store's memory tier below the engine (the CPU tier) until
a deadline; eviction passes them over meanwhile. Each tenant (namespace and cache salt: a
`BlockKey.tenant`) may hold at most `budget_blocks` retained blocks, so one client cannot pin
the cache, and all together at most `TOTAL_SHARE` of the tier, so unhinted work keeps room;
what does not fit, or is not in that tier, is reported as clipped. Retaining a
block again extends its deadline without charging it twice. Expired blocks are unpinned by
`expire`, which the store calls on each write and retain (the caller holds the store's lock).

`protect` (the "high" priority, `kvstore/priority.py`) retains without a deadline, from the
same budget: a tenant's oldest protected blocks return to normal when its newer ones need the
room (never those of the same call); what still does not fit is clipped. `unprotect` ends it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from tiers.base import Tier
from tiers.keys import BlockHash, BlockKey

MAX_RETAIN_S = 24 * 3600.0  # the longest a caller may ask a prefix to be kept
TOTAL_SHARE = 0.75  # all tenants together retain at most this share of the tier: unhinted work keeps room


class RetainResult(NamedTuple):
    """What `retain` did: blocks now retained (newly or extended) and blocks it could not
    retain (over the tenant's budget, or not in the memory tier)."""

    num_retained: int
    num_clipped: int


class Retention:
    """Retained blocks of one store's memory tier (see the module docstring)."""

    def __init__(self, tier: Tier | None, budget_blocks: int) -> None:
        self._tier = tier
        self.budget_blocks = budget_blocks
        self.total_blocks = int(TOTAL_SHARE * tier.capacity_blocks) if tier is not None else 0
        self._until: dict[BlockHash, float] = {}
        self._owner: dict[BlockHash, bytes] = {}
        self._charged: dict[bytes, int] = {}
        self._heap: list[tuple[float, BlockHash]] = []  # (deadline, block); stale entries skipped
        self._protected: dict[bytes, OrderedDict[BlockHash, None]] = {}  # tenant -> its high blocks, oldest first
        self.num_clipped = 0

    def __len__(self) -> int:
        return len(self._until)

    def retain(self, keys: Sequence[BlockKey], seconds: float, now: float | None = None) -> RetainResult:
        """Pin `keys`' blocks held in the memory tier until `now + seconds`, within each
        tenant's budget; see the module docstring."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        until = now + seconds
        retained = clipped = 0
        for key in keys:
            h = key.block_hash
            if h in self._until:
                if until > self._until[h]:
                    self._until[h] = until
                    self._push(until, h)
                retained += 1
                continue
            tenant = key.tenant
            if self._tier is None or self._charged.get(tenant, 0) >= self.budget_blocks \
                    or len(self._until) >= self.total_blocks or not self._tier.pin([h]):
                clipped += 1
                continue
            self._until[h], self._owner[h] = until, tenant
            self._charged[tenant] = self._charged.get(tenant, 0) + 1
            self._push(until, h)
            retained += 1
        self.num_clipped += clipped
        return RetainResult(retained, clipped)

    @property
    def num_deadlines(self) -> int:
        """Deadlines kept, stale ones included (at most about twice the retained blocks)."""
        return len(self._heap)

    def _push(self, until: float, h: BlockHash) -> None:
        """Record `h`'s deadline; an extension leaves the old one stale, so once the stale
        outnumber the live the heap is rebuilt from the live ones (bounded by the blocks
        retained, however often a hot prefix is retained again)."""
        heapq.heappush(self._heap, (until, h))
        if len(self._heap) > 2 * len(self._until) + 64:
            self._heap = [(t, b) for b, t in self._until.items() if t != math.inf]
            heapq.heapify(self._heap)

    def protect(self, keys: Sequence[BlockKey], now: float | None = None) -> RetainResult:
        """Retain `keys`' blocks held in the memory tier with no deadline (high priority),
        within each tenant's budget; see the module docstring."""
        self.expire(now)
        call: set[BlockHash] = set()
        retained = clipped = 0
        for key in keys:
            h = key.block_hash
            if h in self._until:
                self._until[h] = math.inf  # its heap entry goes stale
            else:
                tenant = key.tenant
                if self._tier is None or not self._tier.pin([h]):  # not held there: nothing gives way
                    clipped += 1
                    continue
                mine = self._protected.get(tenant)
                while mine and next(iter(mine)) not in call and self._full(tenant):
                    self._release(next(iter(mine)))  # the tenant's oldest high block returns to normal
                    mine = self._protected.get(tenant)
                if self._full(tenant):
                    self._tier.unpin([h])
                    clipped += 1
                    continue
                self._until[h], self._owner[h] = math.inf, tenant
                self._charged[tenant] = self._charged.get(tenant, 0) + 1
            mine = self._protected.setdefault(self._owner[h], OrderedDict())
            mine[h] = None
            mine.move_to_end(h)
            call.add(h)
            retained += 1
        self.num_clipped += clipped
        return RetainResult(retained, clipped)

    def _full(self, tenant: bytes) -> bool:
        """Whether `tenant`'s budget, or the share all tenants together may keep, is used up."""
        return self._charged.get(tenant, 0) >= self.budget_blocks or len(self._until) >= self.total_blocks

    def unprotect(self, hashes: Sequence[BlockHash]) -> int:
        """End the high priority of the given blocks (unpinned: normal again, a retain on
        them included); how many had it."""
        held = [h for h in hashes if self._until.get(h) == math.inf]
        for h in held:
            self._release(h)
        return len(held)

    def expire(self, now: float | None = None) -> int:
        """Unpin the blocks whose deadline has passed; how many."""
        now = time.monotonic() if now is None else now
        done = 0
        while self._heap and self._heap[0][0] <= now:
            deadline, h = heapq.heappop(self._heap)
            if self._until.get(h) != deadline:
                continue  # extended since, or released
            self._release(h)
            done += 1
        return done

    def forget(self) -> None:
        """Drop every retention without unpinning (the tier was cleared: its pins are gone)."""
        self._until.clear()
        self._owner.clear()
        self._charged.clear()
        self._heap.clear()
        self._protected.clear()

    def release(self, hashes: Sequence[BlockHash]) -> int:
        """Unpin the given blocks if retained (they are to be removed); how many were."""
        held = [h for h in hashes if h in self._until]
        for h in held:
            self._release(h)
        return len(held)

    def release_all(self) -> None:
        """Unpin every retained block (before the store closes)."""
        for h in list(self._until):
            self._release(h)
        self._heap.clear()

    def _release(self, h: BlockHash) -> None:
        del self._until[h]
        tenant = self._owner.pop(h)
        self._charged[tenant] -= 1
        if not self._charged[tenant]:
            del self._charged[tenant]
        mine = self._protected.get(tenant)
        if mine is not None and h in mine:
            del mine[h]
            if not mine:
                del self._protected[tenant]
        if self._tier is not None:
            self._tier.unpin([h])
