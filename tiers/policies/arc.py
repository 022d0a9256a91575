"""ARC (Megiddo & Modha, FAST'03), with the replacement decoupled from insertion."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tiers.policies.eviction import (
    ColdQueue,
    EvictionConfig,
    EvictionKind,
    EvictionPolicy,
    K,
    delete_from,
    ratio_field,
    register_eviction,
)
from tiers.policies.history import History

GHOST_X = 4.0  # entries of each ghost list, in tier capacities (ARC: one; 4x measured better here)


class ARCPolicy(EvictionPolicy[K]):
    """Two LRU lists, keys used once (`t1`) and keys used again (`t2`), and a ghost list of
    keys evicted from each (`b1`, `b2`). A key inserted while its ghost is remembered goes to
    `t2` and moves the target size `p` of `t1`: up for a `b1` ghost (recency was short), down
    for a `b2` ghost (frequency was short). `pop` evicts the oldest of `t1` while `t1` holds at
    least `p` keys, else the oldest of `t2`.

    The tier, not the policy, decides when to evict (it may hold pinned blocks the policy does
    not see), so `pop` is called only for room, as in vLLM's offloading ARC. Invariant: the four
    lists are disjoint, `0 <= p <= capacity`, each ghost list holds at most `GHOST_X` capacities.
    """

    kind = EvictionKind.ARC

    def __init__(self, capacity_blocks: int, *, ghost_x: float = GHOST_X) -> None:
        super().__init__(capacity_blocks)
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1: History[K, None] = History(ghost_x, capacity_blocks)
        self._b2: History[K, None] = History(ghost_x, capacity_blocks)
        self._cold: ColdQueue[K] = ColdQueue(self._b1.limit)  # low-priority keys, popped first
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._cold

    def insert(self, key: K) -> None:
        b1, b2 = self._b1, self._b2
        self._cold.forget(key)  # returns as new
        if key in b1:
            self.p = min(float(self.capacity_blocks), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            self._t2[key] = None
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def access(self, key: K) -> None:
        if self._cold and key in self._cold:
            del self._cold[key]
            self._t1[key] = None
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def refresh(self, key: K) -> None:
        if self._cold and key in self._cold:
            del self._cold[key]
            self._t1[key] = None
        if key in self._t1:
            self._t1.move_to_end(key)
        else:
            self._t2.move_to_end(key)

    def remove(self, key: K) -> None:
        delete_from(key, self._t1, self._t2, self._cold)

    def pop(self) -> K:
        t1 = self._t1
        if self._cold:
            return self._cold.pop_front(len(self))
        if t1 and (len(t1) >= max(1.0, self.p) or not self._t2):
            key = t1.popitem(last=False)[0]
            self._b1.remember(key, None)
        elif self._t2:
            key = self._t2.popitem(last=False)[0]
            self._b2.remember(key, None)
        else:
            raise IndexError("pop from an empty ARC policy")
        return key

    def restore(self, key: K) -> None:
        if self._cold.unpop(key):
            return
        if key in self._b1:
            del self._b1[key]
            self._t1[key] = None
            self._t1.move_to_end(key, last=False)
        else:
            self._b2.pop(key, None)
            self._t2[key] = None
            self._t2.move_to_end(key, last=False)

    def deprioritize(self, key: K) -> None:
        """At the front of the cold list, which `pop` empties before `t1` and `t2`."""
        self.remove(key)
        self._cold.push_front(key)

    def order(self) -> Iterator[K]:
        return itertools.chain(self._cold, self._t1, self._t2)

    def histories(self) -> tuple[History[K, None], ...]:
        return self._b1, self._b2

    def clear(self) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2, self._cold):
            d.clear()
        self.p = 0.0

    def check_integrity(self) -> None:
        lists = [self._t1.keys(), self._t2.keys(), self._b1.keys(), self._b2.keys(), self._cold.keys()]
        if sum(len(x) for x in lists) != len(set().union(*lists)):
            raise RuntimeError("ARC: a key is in two of t1, t2, b1, b2, cold (a bug)")
        self._cold.check_integrity(self, "ARC")
        if not 0.0 <= self.p <= self.capacity_blocks:
            raise RuntimeError(f"ARC: target size p={self.p} is outside [0, {self.capacity_blocks}] (a bug)")
        if max(len(self._b1), len(self._b2)) > self._b1.limit:
            raise RuntimeError("ARC: a ghost list is over its limit (a bug)")


@register_eviction("arc")
@dataclass(frozen=True)
class ARCConfig(EvictionConfig):
    """ARC: `ghost_x` is the entries of each ghost list, in tier capacities."""

    ghost_x: float = ratio_field(GHOST_X)

    def make(self, capacity_blocks: int) -> EvictionPolicy[Any]:
        return ARCPolicy(capacity_blocks, ghost_x=self.ghost_x)
