"""Per-tenant quotas on a shared tier: one eviction order per tenant, and who evicts next.

A tenant is an opaque label of a block (the store's hash of a namespace and cache salt;
`NO_TENANT` when a block carries none). Each tenant has its own eviction policy over its own
evictable blocks and may hold `quota_blocks` blocks before it is "over quota". Room for a
tenant's new blocks is taken, in this order:

1. from an idle tenant: one with no block added or hit while `idle_after` blocks (the tier's
   capacity) were added to the tier, the least recently active first;
2. from the tenant itself, for as many blocks as it would exceed its quota by;
3. from a tenant over its quota (the first such tenant in insertion order);
4. from the tenant itself again, while it has evictable blocks;
5. from the tenant holding the most evictable blocks (quotas oversubscribed the tier).

So a tenant within its quota keeps its blocks however much another tenant writes, as long
as the quotas of all tenants fit the tier and it keeps using them; a tenant gone idle for a
whole turnover of the tier no longer reserves its share. Counters per tenant are kept under a
hashed label.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

import xxhash

from tiers.base import TenantStats
from tiers.eviction import EvictionPolicy, K

NO_TENANT = b""


def tenant_label(tenant: bytes) -> str:
    """The label a tenant's metrics are published under: 16 hex digits of a hash of it
    (`default` for `NO_TENANT`), so that metrics never reveal a cache salt."""
    return "default" if tenant == NO_TENANT else xxhash.xxh3_64_hexdigest(b"kvstrata-tenant\x00" + tenant)


@dataclass
class TenantCounters:
    """One tenant's share of a tier: blocks held now (pinned included) and pinned, and
    counters since the tier opened."""

    num_blocks: int = 0
    num_pinned: int = 0
    num_hits: int = 0
    num_puts: int = 0
    num_evictions: int = 0


class TenantBook(Generic[K]):
    """The eviction policy and counters of every tenant of one tier.

    Invariant: a tenant's policy holds exactly its unpinned-or-pinned evictable candidates
    (pinned blocks stay in it and are skipped by the caller), `num_blocks` counts its held
    blocks, and `over` lists exactly the tenants holding more than `quota_blocks`.
    """

    def __init__(self, make_policy: Callable[[int], EvictionPolicy[K]], quota_blocks: int, idle_after: int) -> None:
        if quota_blocks <= 0:
            raise ValueError(f"a tenant quota must be > 0 blocks, got {quota_blocks}")
        self.quota_blocks = quota_blocks
        self.idle_after = idle_after
        self.clock = 0  # blocks added to the tier
        self.activity: OrderedDict[bytes, int] = OrderedDict()  # tenants holding blocks -> last active
        self._make = make_policy
        self.policies: dict[bytes, EvictionPolicy[K]] = {}
        self.counters: dict[bytes, TenantCounters] = {}
        self.over: dict[bytes, None] = {}  # tenants over quota, in the order they went over

    def policy(self, tenant: bytes) -> EvictionPolicy[K]:
        """The tenant's policy (created empty on first use)."""
        pol = self.policies.get(tenant)
        if pol is None:
            pol = self.policies[tenant] = self._make(self.quota_blocks)
            self.counters[tenant] = TenantCounters()
        return pol

    def active(self, tenant: bytes) -> None:
        """The tenant used its blocks now (a hit)."""
        if tenant in self.activity:
            self.activity[tenant] = self.clock
            self.activity.move_to_end(tenant)

    def added(self, tenant: bytes) -> None:
        c = self.counters[tenant]
        c.num_blocks += 1
        c.num_puts += 1
        if c.num_blocks > self.quota_blocks:
            self.over[tenant] = None
        self.clock += 1
        self.activity[tenant] = self.clock
        self.activity.move_to_end(tenant)

    def removed(self, tenant: bytes, *, evicted: bool) -> None:
        c = self.counters[tenant]
        c.num_blocks -= 1
        if evicted:
            c.num_evictions += 1
        if c.num_blocks <= self.quota_blocks:
            self.over.pop(tenant, None)
        if not c.num_blocks:
            self.activity.pop(tenant, None)

    def evictable(self, tenant: bytes) -> int:
        pol = self.policies.get(tenant)
        return 0 if pol is None else len(pol) - self.counters[tenant].num_pinned

    def source(self, tenant: bytes, num_incoming: int) -> bytes:
        """The tenant the next victim is taken from, for `num_incoming` more blocks of `tenant`
        (the order in the module docstring). Changes nothing."""
        for idle, last in self.activity.items():  # the least recently active first
            if self.clock - last <= self.idle_after:
                break
            if idle != tenant and self.evictable(idle):
                return idle
        own = self.evictable(tenant)
        if own and self.counters[tenant].num_blocks + num_incoming > self.quota_blocks:
            return tenant
        for other in self.over:
            if self.evictable(other):
                return other
        if own:
            return tenant
        return max(self.policies, key=self.evictable)

    def stats(self) -> list[TenantStats]:
        """Every tenant's counters under its hashed label; changes nothing."""
        return [TenantStats(tenant_label(t), c.num_blocks, self.quota_blocks, c.num_hits, c.num_puts,
                            c.num_evictions) for t, c in self.counters.items()]

    def clear(self) -> None:
        for pol in self.policies.values():
            pol.clear()
        self.policies.clear()
        self.counters.clear()
        self.over.clear()
        self.activity.clear()

    def check_integrity(self, held: dict[K, bytes], pins: dict[K, int]) -> None:
        """Check the book against the tier's held blocks (key -> tenant) and pin counts."""
        per: dict[bytes, int] = {}
        pinned: dict[bytes, int] = {}
        for key, tenant in held.items():
            per[tenant] = per.get(tenant, 0) + 1
            if key in pins:
                pinned[tenant] = pinned.get(tenant, 0) + 1
            pol = self.policies.get(tenant)
            if pol is None or key not in pol:
                raise RuntimeError("tenant book: a held block is not in its tenant's policy (a bug)")
        for tenant, c in self.counters.items():
            if c.num_blocks != per.get(tenant, 0) or c.num_pinned != pinned.get(tenant, 0):
                raise RuntimeError(f"tenant {tenant_label(tenant)}: counts disagree with the tier (a bug)")
            if len(self.policies[tenant]) != c.num_blocks:
                raise RuntimeError(f"tenant {tenant_label(tenant)}: its policy holds other blocks (a bug)")
            if (tenant in self.over) != (c.num_blocks > self.quota_blocks):
                raise RuntimeError(f"tenant {tenant_label(tenant)}: over-quota mark is wrong (a bug)")
            if (tenant in self.activity) != (c.num_blocks > 0):
                raise RuntimeError(f"tenant {tenant_label(tenant)}: activity kept for a tenant without blocks (a bug)")
        for pol in self.policies.values():
            pol.check_integrity()
