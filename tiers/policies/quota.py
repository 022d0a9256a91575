"""Per-tenant quotas on a shared tier: one eviction order per tenant, and who evicts next.

A tenant is an opaque label of a block (the store's hash of a namespace and cache salt;
`NO_TENANT` when a block carries none). Each tenant has its own eviction policy over its own
evictable blocks and may hold `quota_blocks` blocks before it is "over quota". Room for a
tenant's new blocks is taken, in this order:

1. from an idle tenant: one with no block added or hit while `idle_after` blocks (the tier's
   capacity) were added to the tier, the least recently active first;
2. from the tenant itself, for as many blocks as it would exceed its quota by;
3. from a tenant over its quota (the first to go over, or to regain an evictable block while
   over, among those with evictable blocks);
4. from the tenant itself again, while it has evictable blocks;
5. from the tenant holding the most evictable blocks (quotas oversubscribed the tier).

So a tenant within its quota keeps its blocks however much another tenant writes, as long
as the quotas of all tenants fit the tier and it keeps using them; a tenant gone idle for a
whole turnover of the tier no longer reserves its share.

Bounds, however many tenants come and go: the book keeps only tenants holding blocks (at most
one per held block). A tenant whose last block leaves is forgotten, its policy and ghosts with
it, its counters added to `other`. A tenant's ghost and history lists are trimmed to what its
policy keeps for a tier of `HISTORY_SLACK` times the blocks it holds (`trim_history`; the slack
spares them while a put evicts the tenant's own blocks first). Each choice above costs
O(log tenants) amortised: a heap by last activity (step 1), an ordered set (step 3) and
buckets by evictable count (step 5), updated as blocks enter, leave, are pinned. Counters are
reported under hashed labels for at most `LABELLED_TENANTS` tenants at a time; the others, and
every forgotten tenant, are summed under `OTHER_LABEL`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic

import xxhash

from tiers.base import TenantStats
from tiers.policies.eviction import EvictionPolicy, K

NO_TENANT = b""
LABELLED_TENANTS = 100  # tenants reported under their own label at a time (the rest: `other`)
OTHER_LABEL = "other"  # the sum of unlabelled and forgotten tenants (never a hashed label)
HISTORY_SLACK = 2  # a tenant keeps the ghosts of a tier twice its blocks (a put evicts its own first)
_HEAP_SLACK = 64  # stale idle-heap entries allowed beyond one per tenant before a rebuild


def tenant_label(tenant: bytes) -> str:
    """The label a tenant's metrics are published under: 16 hex digits of a hash of it
    (`default` for `NO_TENANT`), so that metrics never reveal a cache salt."""
    return "default" if tenant == NO_TENANT else xxhash.xxh3_64_hexdigest(b"kvstrata-tenant\x00" + tenant)


@dataclass
class TenantCounters:
    """A share of a tier summed over tenants (`other`): blocks held now (pinned included) and
    pinned, and hits, puts and evictions."""

    num_blocks: int = 0
    num_pinned: int = 0
    num_hits: int = 0
    num_puts: int = 0
    num_evictions: int = 0


class _Tenant(Generic[K]):
    """A tenant holding blocks: its policy, counters (as `TenantCounters`) and place in the
    book's orders."""

    __slots__ = ("evictable", "labelled", "last_active", "num_blocks", "num_evictions", "num_hits", "num_pinned",
                 "num_puts", "over", "policy", "queued", "serial")

    def __init__(self, policy: EvictionPolicy[K], serial: int, labelled: bool) -> None:
        self.policy = policy
        self.num_blocks = self.num_pinned = self.num_hits = self.num_puts = self.num_evictions = 0
        self.evictable = 0  # len(policy) - num_pinned
        self.over = False  # in the book's `_over`: over quota with evictable blocks
        self.last_active = 0  # the book's clock at its last add or hit
        self.serial = serial  # tells this record's idle-heap entry from a forgotten namesake's
        self.queued = False  # it has an entry in the idle heap
        self.labelled = labelled  # reported under its own label


class TenantBook(Generic[K]):
    """The eviction policy and counters of every tenant holding blocks in one tier.

    The tier routes every change of a tenant's policy size or pins through `insert`, `pop`,
    `restore`, `remove`, `pinned`, `removed` (uses go to `policy(tenant)` directly).
    Invariant: the tenants kept are exactly those holding blocks; a tenant's policy holds
    exactly its held blocks (pinned ones too: the caller skips them) outside `pop`..`removed`;
    `evictable` is its policy's size less its pins; `_over` lists exactly the tenants over
    quota with evictable blocks, `_buckets[n]` exactly those with n > 0 evictable blocks.
    """

    def __init__(self, make_policy: Callable[[int], EvictionPolicy[K]], quota_blocks: int, idle_after: int, *,
                 labelled_tenants: int = LABELLED_TENANTS) -> None:
        if quota_blocks <= 0:
            raise ValueError(f"a tenant quota must be > 0 blocks, got {quota_blocks}")
        if labelled_tenants < 0:
            raise ValueError(f"labelled_tenants must be >= 0, got {labelled_tenants}")
        self.quota_blocks = quota_blocks
        self.idle_after = idle_after
        self.labelled_tenants = labelled_tenants
        self.clock = 0  # blocks added to the tier
        self.num_blocks = 0  # blocks held by all tenants
        self._make = make_policy
        self._tenants: dict[bytes, _Tenant[K]] = {}
        self._serial = 0
        self._idle: list[tuple[int, int, bytes]] = []  # (last active, serial, tenant), pruned lazily
        self._over: dict[bytes, None] = {}  # over quota with evictable blocks, first to go over first
        self._buckets: dict[int, dict[bytes, None]] = {}  # n > 0 -> tenants with n evictable blocks
        self._most = 0  # the largest n in `_buckets` (0: empty)
        self._num_labelled = 0
        self._other = TenantCounters()  # counters of forgotten tenants

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_tenants_tracked(self) -> int:
        """Tenants the book keeps state for: those holding blocks now."""
        return len(self._tenants)

    def policy(self, tenant: bytes) -> EvictionPolicy[K]:
        """The policy of a tenant holding blocks, for uses (`KeyError` for any other)."""
        return self._tenants[tenant].policy

    def order(self) -> Iterator[K]:
        """Every tenant's blocks in its eviction order, tenant after tenant; changes nothing."""
        return (k for rec in self._tenants.values() for k in rec.policy.order())

    def stats(self) -> list[TenantStats]:
        """The counters of the labelled tenants under their hashed labels, then (once any
        tenant is unlabelled or forgotten) their sum under `OTHER_LABEL`; changes nothing."""
        out: list[TenantStats] = []
        other = TenantCounters(0, 0, self._other.num_hits, self._other.num_puts, self._other.num_evictions)
        for tenant, c in self._tenants.items():
            if c.labelled:
                out.append(TenantStats(tenant_label(tenant), c.num_blocks, self.quota_blocks, c.num_hits,
                                       c.num_puts, c.num_evictions))
            else:
                other.num_blocks += c.num_blocks
                other.num_hits += c.num_hits
                other.num_puts += c.num_puts
                other.num_evictions += c.num_evictions
        if other.num_puts:
            out.append(TenantStats(OTHER_LABEL, other.num_blocks, self.quota_blocks, other.num_hits,
                                   other.num_puts, other.num_evictions))
        return out

    # -- changes ---------------------------------------------------------------------------
    def insert(self, tenant: bytes, key: K) -> None:
        """A new block `key` of `tenant` enters the tier, evictable: a put and an activity."""
        rec = self._tenants.get(tenant)
        if rec is None:
            labelled = self._num_labelled < self.labelled_tenants
            self._num_labelled += labelled
            self._serial += 1
            rec = self._tenants[tenant] = _Tenant(self._make(self.quota_blocks), self._serial, labelled)
        rec.policy.insert(key)
        rec.num_blocks += 1
        rec.num_puts += 1
        self.num_blocks += 1
        self.clock += 1
        rec.last_active = self.clock
        self._shift(tenant, rec, 1)

    def hit(self, tenant: bytes) -> None:
        """A held block of `tenant` was read: a hit and an activity."""
        rec = self._tenants[tenant]
        rec.num_hits += 1
        rec.last_active = self.clock

    def pop(self, tenant: bytes, num_incoming: int) -> tuple[bytes, K]:
        """Take the next victim for `num_incoming` more blocks of `tenant` out of the policy of
        the tenant `source` names; return that tenant and the key (`removed` or `restore` next)."""
        source = self.source(tenant, num_incoming)
        rec = self._tenants[source]
        key = rec.policy.pop()
        self._shift(source, rec, -1)
        return source, key

    def restore(self, tenant: bytes, key: K) -> None:
        """Undo the `pop` of `key`: back in the policy, next to go."""
        rec = self._tenants[tenant]
        rec.policy.restore(key)
        self._shift(tenant, rec, 1)

    def remove(self, tenant: bytes, key: K) -> None:
        """Take a held `key` out of its policy outside eviction (a discard; `removed` follows)."""
        rec = self._tenants[tenant]
        rec.policy.remove(key)
        self._shift(tenant, rec, -1)

    def pinned(self, tenant: bytes, delta: int) -> None:
        """A block of `tenant` was pinned (`delta` 1) or unpinned (-1)."""
        rec = self._tenants[tenant]
        rec.num_pinned += delta
        self._shift(tenant, rec, -delta)

    def removed(self, tenant: bytes, *, evicted: bool) -> None:
        """A block of `tenant`, out of its policy, left the tier; its last: the tenant is forgotten."""
        rec = self._tenants[tenant]
        n = rec.num_blocks = rec.num_blocks - 1
        self.num_blocks -= 1
        if evicted:
            rec.num_evictions += 1
        if not n:
            self._forget(tenant, rec)
            return
        if HISTORY_SLACK * n < self.quota_blocks:  # else within the policy's own limit
            rec.policy.trim_history(HISTORY_SLACK * n)
        if rec.over and n <= self.quota_blocks:
            self._set_over(tenant, rec, False)

    def clear(self) -> None:
        """Forget every tenant and counter."""
        self._tenants.clear()
        self._idle.clear()
        self._over.clear()
        self._buckets.clear()
        self._most = self._num_labelled = self.num_blocks = 0
        self._other = TenantCounters()

    def _forget(self, tenant: bytes, rec: _Tenant[K]) -> None:
        del self._tenants[tenant]
        if rec.evictable > 0 or len(rec.policy):
            raise RuntimeError(f"tenant {tenant_label(tenant)}: forgotten with blocks in its policy (a bug)")
        self._over.pop(tenant, None)
        self._num_labelled -= rec.labelled
        other = self._other
        other.num_hits += rec.num_hits
        other.num_puts += rec.num_puts
        other.num_evictions += rec.num_evictions
        if len(self._idle) > 2 * len(self._tenants) + _HEAP_SLACK:
            self._rebuild_idle()

    def _shift(self, tenant: bytes, rec: _Tenant[K], delta: int) -> None:
        """Change `tenant`'s evictable count by `delta` (+-1) and its place in the orders."""
        old = rec.evictable
        new = rec.evictable = old + delta
        buckets = self._buckets
        if old > 0:
            bucket = buckets[old]
            if len(bucket) > 1:
                del bucket[tenant]
            else:
                del buckets[old]
                if old == self._most and new < old:  # every other tenant holds fewer than `old`
                    self._most = new
        if new > 0:
            into = buckets.get(new)
            if into is not None:
                into[tenant] = None
            else:
                buckets[new] = {tenant: None}
                if new > self._most:
                    self._most = new
            if not rec.queued:
                rec.queued = True
                heapq.heappush(self._idle, (rec.last_active, rec.serial, tenant))
        over = new > 0 and rec.num_blocks > self.quota_blocks
        if over is not rec.over:
            self._set_over(tenant, rec, over)

    def _set_over(self, tenant: bytes, rec: _Tenant[K], over: bool) -> None:
        rec.over = over
        if over:
            self._over[tenant] = None
        else:
            del self._over[tenant]

    def _rebuild_idle(self) -> None:
        """The idle heap anew, one entry per tenant with evictable blocks (drops stale ones)."""
        self._idle = []
        for tenant, rec in self._tenants.items():
            rec.queued = rec.evictable > 0
            if rec.queued:
                self._idle.append((rec.last_active, rec.serial, tenant))
        heapq.heapify(self._idle)

    # -- victims ---------------------------------------------------------------------------
    def source(self, tenant: bytes, num_incoming: int) -> bytes:
        """The tenant the next victim is taken from, for `num_incoming` more blocks of `tenant`
        (the order in the module docstring). Changes no choice, only prunes stale entries."""
        idle_heap = self._idle
        if idle_heap and idle_heap[0][0] < self.clock - self.idle_after:
            idle = self._oldest_idle(tenant)
            if idle is not None:
                return idle
        rec = self._tenants.get(tenant)
        own = rec is not None and rec.evictable > 0
        if rec is not None and own and rec.num_blocks + num_incoming > self.quota_blocks:
            return tenant
        for over in self._over:
            return over
        if own:
            return tenant
        if not self._most:
            raise RuntimeError("tenant book: no tenant has an evictable block (a bug)")
        return next(iter(self._buckets[self._most]))

    def _oldest_idle(self, tenant: bytes) -> bytes | None:
        """The least recently active idle tenant other than `tenant` with evictable blocks.
        Entries are fixed at the top of the heap: a forgotten tenant's dropped, a tenant
        active since re-queued at its last activity, one with nothing to evict dequeued."""
        heap, limit = self._idle, self.clock - self.idle_after
        own: list[tuple[int, int, bytes]] = []
        found = None
        while heap and heap[0][0] < limit:
            last, serial, t = heap[0]
            rec = self._tenants.get(t)
            if rec is None or rec.serial != serial:
                heapq.heappop(heap)
            elif rec.evictable <= 0:
                heapq.heappop(heap)
                rec.queued = False
            elif rec.last_active != last:
                heapq.heapreplace(heap, (rec.last_active, serial, t))
            elif t == tenant:
                own.append(heapq.heappop(heap))
            else:
                found = t
                break
        for entry in own:
            heapq.heappush(heap, entry)
        return found

    # -- checks ----------------------------------------------------------------------------
    def check_integrity(self, held: dict[K, bytes], pins: dict[K, int]) -> None:
        """Check the book against the tier's held blocks (key -> tenant) and pin counts, and
        its totals and orders against its tenants."""
        per: dict[bytes, int] = {}
        pinned: dict[bytes, int] = {}
        for key, tenant in held.items():
            per[tenant] = per.get(tenant, 0) + 1
            if key in pins:
                pinned[tenant] = pinned.get(tenant, 0) + 1
            rec = self._tenants.get(tenant)
            if rec is None or key not in rec.policy:
                raise RuntimeError("tenant book: a held block is not in its tenant's policy (a bug)")
        if per.keys() != self._tenants.keys():
            raise RuntimeError("tenant book: a tenant holding no block is kept (a bug)")
        if self.num_blocks != len(held):
            raise RuntimeError(f"tenant book: {self.num_blocks} blocks counted, {len(held)} held (a bug)")
        queued = {serial for _, serial, _ in self._idle}
        for tenant, rec in self._tenants.items():
            label = tenant_label(tenant)
            if rec.num_blocks != per[tenant] or rec.num_pinned != pinned.get(tenant, 0):
                raise RuntimeError(f"tenant {label}: counts disagree with the tier (a bug)")
            if len(rec.policy) != rec.num_blocks or rec.evictable != rec.num_blocks - rec.num_pinned:
                raise RuntimeError(f"tenant {label}: its policy holds other blocks (a bug)")
            over = rec.num_blocks > self.quota_blocks and rec.evictable > 0
            if not rec.over == (tenant in self._over) == over:
                raise RuntimeError(f"tenant {label}: over-quota mark is wrong (a bug)")
            if (rec.evictable > 0) != (tenant in self._buckets.get(rec.evictable, {})):
                raise RuntimeError(f"tenant {label}: not in the bucket of its evictable count (a bug)")
            if rec.evictable > 0 and not (rec.queued and rec.serial in queued):
                raise RuntimeError(f"tenant {label}: evictable but not in the idle heap (a bug)")
            if rec.policy.num_remembered > rec.policy.history_limit(HISTORY_SLACK * rec.num_blocks):
                raise RuntimeError(f"tenant {label}: history beyond what its blocks allow (a bug)")
            rec.policy.check_integrity()
        if sum(map(len, self._buckets.values())) != sum(r.evictable > 0 for r in self._tenants.values()):
            raise RuntimeError("tenant book: the evictable buckets hold other tenants (a bug)")
        if self._most != max(self._buckets, default=0):
            raise RuntimeError("tenant book: the most-evictable mark is wrong (a bug)")
        labelled = sum(r.labelled for r in self._tenants.values())
        if self._num_labelled != labelled or labelled > self.labelled_tenants:
            raise RuntimeError("tenant book: the labelled tenants are miscounted (a bug)")
        if len(self._idle) > 2 * len(self._tenants) + _HEAP_SLACK:
            raise RuntimeError("tenant book: the idle heap holds too many stale entries (a bug)")
