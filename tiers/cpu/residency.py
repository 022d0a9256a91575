"""A tier's bookkeeping without its bytes: which blocks it holds, pins, their prefix links,
their tenants, and which leave next.

The CPU tier keeps its slots and copies beside one `Residency`; the trace replay
(`bench/trace_sim.py`) drives the same class over block ids, so the policy figures describe
the shipped code (a test replays a trace through both and compares). A disk tier can adopt it
as an in-memory state rebuilt when it opens (see `docs/performance.md`).

Prefixes: a block added with a held parent is linked to it, and a block with held children is
not evicted while another block can be (it is spared as if used): evicting a prefix block
would strand its children, which no lookup can reach without it. Only when every evictable
block has held children (their leaves pinned) is a prefix block evicted.

Uses: `touch` and `add` count a use of a block once per put epoch (`end_put` starts the next),
so the several calls that serve one request (a read, its promotion, its store) are one use
to frequency-counting policies and to the admission sketch, and the later ones only refresh.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, Protocol

from tiers.base import TenantStats
from tiers.keys import BlockHash, BlockKey
from tiers.policies.eviction import EvictionConfig, EvictionKind, EvictionPolicy, K, eviction_config, make_policy
from tiers.policies.quota import NO_TENANT, TenantBook

_NOT_SEEN = -1


def key_parent(key: BlockKey) -> BlockHash | None:
    """The hash of the block before `key` in its sequence, where the key carries one; None
    when it does not: the block is then linked to nothing and only the eviction policy
    orders it."""
    parent = key.parent
    return BlockHash(parent) if parent else None


def key_tenant(key: BlockKey) -> bytes:
    """The tenant label `key` carries (the store's digest of namespace and cache salt);
    `NO_TENANT` when it carries none."""
    return key.tenant or NO_TENANT


class UseCounter(Protocol):
    """Anything told of every use of a block (a `FrequencySketch`)."""

    def add(self, key: Hashable) -> None: ...


class Residency(Generic[K]):
    """The held blocks of one tier and the order in which they leave it.

    Invariant: every held block is in the eviction policy of its tenant (pinned ones too:
    victim selection skips them); `_children[p]` counts the held blocks linked to the held
    block `p`; pin counts are positive. Callers keep `len(self) <= capacity_blocks` by taking
    victims before adding blocks.
    """

    def __init__(self, capacity_blocks: int, eviction: EvictionConfig | EvictionKind | str = EvictionKind.LRU, *,
                 quota_blocks: int | None = None, keep_prefixes: bool = True) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"a tier needs a capacity > 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.eviction = eviction_config(eviction)
        self.keep_prefixes = keep_prefixes
        self._book: TenantBook[K] | None = None
        self._policy: EvictionPolicy[K] = make_policy(self.eviction, capacity_blocks)
        if quota_blocks is not None:
            self._book = TenantBook(lambda cap: make_policy(self.eviction, cap), min(quota_blocks, capacity_blocks),
                                    idle_after=capacity_blocks)
        self._held: dict[K, bytes] = {}  # block -> tenant
        self._pins: dict[K, int] = {}
        self._parent: dict[K, K] = {}  # block -> its held parent, when it had one on arrival
        self._children: dict[K, int] = {}  # held block -> held blocks linked to it (> 0)
        self._counts_uses = self._policy.counts_uses
        self._epoch = 0
        self._last_use: dict[K, int] = {}
        self.on_use: list[UseCounter] = []  # told of every use (admission sketches)
        self.num_stranded = 0  # prefix blocks evicted while children were held

    # -- queries ---------------------------------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy[K]:
        """The eviction policy ordering the blocks outside any tenant book (read it; it is
        this residency's own)."""
        return self._policy

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    @property
    def num_evictable(self) -> int:
        return len(self._held) - len(self._pins)

    def tenant_of(self, key: K) -> bytes:
        return self._held[key]

    def tenant_stats(self) -> list[TenantStats]:
        return [] if self._book is None else self._book.stats()

    @property
    def num_tenants_tracked(self) -> int:
        """Tenants whose policy and counters are kept (those holding blocks; 0 without quotas)."""
        return 0 if self._book is None else self._book.num_tenants_tracked

    @property
    def has_tenants(self) -> bool:
        """Whether quotas are on (and hits are counted per tenant)."""
        return self._book is not None

    def count_hits(self, keys: Sequence[K]) -> None:
        """Count hits on held `keys` per tenant (quotas only; otherwise nothing to count)."""
        book = self._book
        if book is not None:
            for key in keys:
                book.hit(self._held[key])

    def order(self) -> list[K]:
        """Every held block, roughly in eviction order (each tenant's in turn); changes nothing."""
        if self._book is None:
            return list(self._policy.order())
        return list(self._book.order())

    def _policy_of(self, key: K) -> EvictionPolicy[K]:
        return self._policy if self._book is None else self._book.policy(self._held[key])

    # -- uses ------------------------------------------------------------------------------
    def _used(self, key: K) -> bool:
        """Whether this is the first use of `key` in this epoch (and note it)."""
        if self._last_use.get(key, _NOT_SEEN) == self._epoch:
            return False
        self._last_use[key] = self._epoch
        for sketch in self.on_use:
            sketch.add(key)
        return True

    def touch(self, keys: Sequence[K]) -> None:
        """Held `keys` (eviction order) become recent, the last most; a block's first touch in
        this epoch is a use. Absent keys are ignored."""
        held = self._held
        if not self._counts_uses and not self.on_use and self._book is None:
            refresh = self._policy.refresher()
            for key in keys:
                if key in held:
                    refresh(key)
            return
        for key in keys:
            if key in held:
                pol = self._policy_of(key)
                if self._used(key):
                    pol.access(key)
                else:
                    pol.refresh(key)

    def deprioritize(self, keys: Sequence[K]) -> int:
        """Held `keys` become the next to evict in their policy, the last given first (give a
        prefix in order: its tail leaves first); how many were held. Absent keys are ignored."""
        held = [k for k in keys if k in self._held]
        for key in held:
            self._policy_of(key).deprioritize(key)
        return len(held)

    def end_put(self) -> None:
        """Start the next epoch: later touches are new uses."""
        self._epoch += 1

    # -- entering and leaving ----------------------------------------------------------------
    def add(self, key: K, parent: K | None = None, tenant: bytes = NO_TENANT) -> None:
        """Hold a new block `key` (evictable), linked to `parent` if that is held."""
        self._insert(key, tenant)
        if parent is not None:
            self._link(key, parent)

    def add_many(self, keys: Sequence[K], parents: Sequence[K | None] | None = None,
                 tenants: Sequence[bytes] | None = None) -> None:
        """Hold new blocks, entering the eviction order in the order given (a put's eviction
        order); then link each to its parent where that is held, parents among them included.
        None for `parents` / `tenants`: the keys carry none."""
        if tenants is None:
            tenants = [NO_TENANT] * len(keys)
        if self._book is None and not self._counts_uses and not self.on_use:
            held, insert = self._held, self._policy.inserter()
            for key, tenant in zip(keys, tenants):
                held[key] = tenant
                insert(key)
        else:
            for key, tenant in zip(keys, tenants):
                self._insert(key, tenant)
        if parents is not None:
            for key, parent in zip(keys, parents):
                if parent is not None:
                    self._link(key, parent)

    def _insert(self, key: K, tenant: bytes) -> None:
        self._held[key] = tenant
        if self._book is None:
            self._policy.insert(key)
        else:
            self._book.insert(tenant, key)
        if self._counts_uses or self.on_use:
            self._used(key)

    def _link(self, key: K, parent: K) -> None:
        if self.keep_prefixes and parent in self._held and key not in self._parent:
            self._parent[key] = parent
            self._children[parent] = self._children.get(parent, 0) + 1

    def take_victims(self, num: int, tenant: bytes = NO_TENANT) -> list[K]:
        """Choose `num` blocks to evict for `num` new blocks of `tenant` and take them out of
        the eviction order (pinned blocks and, while possible, blocks with held children are
        spared). The caller then `commit`s them (gone) or `restore`s them (kept)."""
        if num > self.num_evictable:
            raise RuntimeError(f"asked for {num} victims but only {self.num_evictable} blocks are evictable (a bug)")
        pins, children = self._pins, self._children
        if self._book is None and not pins and not children:  # nothing to spare: the policy's order
            return self._policy.pop_many(num)  # (no children: no links either)
        victims: list[K] = []
        spared, limit, strand = 0, 2 * len(self._held) + 2, not self.keep_prefixes
        book = self._book
        while len(victims) < num:
            source, key = (NO_TENANT, self._policy.pop()) if book is None else book.pop(tenant, num - len(victims))
            if key in pins or (not strand and key in children):
                if book is None:
                    self._policy.restore(key)
                else:
                    book.restore(source, key)
                self._policy_of(key).access(key)  # moves it away from the eviction end
                spared += 1
                if spared > limit:
                    strand, spared = True, 0
                continue
            if key in children:
                self.num_stranded += 1
            parent = self._parent.get(key)
            if parent is not None:
                self._unlink_child(parent)
            victims.append(key)
        return victims

    def restore(self, victims: Sequence[K]) -> None:
        """Undo `take_victims`: the victims are evictable again, first to go, as they were."""
        for key in reversed(victims):
            if self._book is None:
                self._policy.restore(key)
            else:
                self._book.restore(self._held[key], key)
            parent = self._parent.get(key)
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1

    def commit(self, victims: Sequence[K]) -> None:
        """Forget victims taken by `take_victims`: they left the tier."""
        if not (self._parent or self._children or self._pins or self._last_use or self._book is not None):
            held = self._held
            for key in victims:  # nothing else to forget (LRU, no links, pins or tenants)
                del held[key]
            return
        for key in victims:
            self._parent.pop(key, None)
            self._forget(key, evicted=True)

    def discard(self, key: K) -> None:
        """Forget a held block leaving the tier outside eviction (deleted, failed validation),
        pinned or not."""
        if self._book is None:
            self._policy.remove(key)
        else:
            self._book.remove(self._held[key], key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._unlink_child(parent)
        self._forget(key, evicted=False)

    def _forget(self, key: K, *, evicted: bool) -> None:
        tenant = self._held.pop(key)
        self._last_use.pop(key, None)
        if self._pins.pop(key, None) is not None and self._book is not None:
            self._book.pinned(tenant, -1)
        if self._children.pop(key, None) is not None:  # its children lose their link
            for child in [c for c, p in self._parent.items() if p == key]:
                del self._parent[child]
        if self._book is not None:
            self._book.removed(tenant, evicted=evicted)

    def _unlink_child(self, parent: K) -> None:
        n = self._children[parent] - 1
        if n:
            self._children[parent] = n
        else:
            del self._children[parent]

    def clear(self) -> None:
        """Forget every block, history and tenants included."""
        self._policy.clear()
        if self._book is not None:
            self._book.clear()
        for d in (self._held, self._pins, self._parent, self._children, self._last_use):
            d.clear()

    # -- pins ------------------------------------------------------------------------------
    def pin(self, key: K) -> bool:
        """Protect a held block from eviction until `unpin`; False if it is not held."""
        if key not in self._held:
            return False
        count = self._pins.get(key, 0)
        self._pins[key] = count + 1
        if count == 0 and self._book is not None:
            self._book.pinned(self._held[key], 1)
        return True

    def unpin(self, key: K) -> None:
        """Undo one `pin`; a block deleted meanwhile is skipped. `RuntimeError` if a held block
        is not pinned (a bug of the caller)."""
        count = self._pins.get(key)
        if count is None:
            if key in self._held:
                raise RuntimeError(f"unpin of block {key!r} that is not pinned (a bug)")
            return
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        if self._book is not None:
            self._book.pinned(self._held[key], -1)

    def is_pinned(self, key: K) -> bool:
        return key in self._pins

    def check_integrity(self) -> None:
        """Raise `RuntimeError` (a bug) if the bookkeeping disagrees with itself."""
        held = self._held
        if self._book is None:
            if len(self._policy) != len(held) or any(k not in self._policy for k in held):
                raise RuntimeError("residency: the eviction policy does not hold exactly the held blocks (a bug)")
            self._policy.check_integrity()
        else:
            self._book.check_integrity(held, self._pins)
        if any(k not in held for k in self._pins) or any(c <= 0 for c in self._pins.values()):
            raise RuntimeError("residency: a pin count is on an absent block or not positive (a bug)")
        links: dict[K, int] = {}
        for child, parent in self._parent.items():
            if child not in held or parent not in held:
                raise RuntimeError("residency: a prefix link names an absent block (a bug)")
            links[parent] = links.get(parent, 0) + 1
        if links != self._children:
            raise RuntimeError("residency: child counts disagree with the prefix links (a bug)")
