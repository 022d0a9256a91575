"""LFU with saturating, aged counts and a history of evicted keys: O(1) per operation."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tiers.policies.eviction import (
    EvictionConfig,
    EvictionKind,
    EvictionPolicy,
    K,
    ratio_field,
    register_eviction,
)
from tiers.policies.history import History

MAX_COUNT = 15  # counts saturate here (4 bits, as TinyLFU's counters)
AGE_X = 8  # every AGE_X capacities of uses, every count is halved (old popularity fades)
HISTORY_X = 4.0  # counts of evicted keys remembered, in tier capacities


class LFUPolicy(EvictionPolicy[K]):
    """Least frequently used first; among equal counts, least recently used first.

    One LRU bucket per count (1..MAX_COUNT); `pop` takes the oldest key of the lowest
    non-empty bucket. A key evicted or removed leaves its count in a bounded history, so a
    popular block that returns (after an eviction, or a pin) is not treated as new. After
    `AGE_X` capacities of uses every count is halved (the buckets are merged in order).

    Under a prefix cache a parent block is used whenever its children are, so its count is at
    least theirs, and (refreshed after them) it is the more recent among equals: children
    leave first. Invariant: each held key is in exactly the bucket of its count.
    """

    kind = EvictionKind.LFU

    def __init__(self, capacity_blocks: int, *, history_x: float = HISTORY_X) -> None:
        super().__init__(capacity_blocks)
        self._count: dict[K, int] = {}
        self._buckets: list[OrderedDict[K, None]] = [OrderedDict() for _ in range(MAX_COUNT + 1)]
        self._history: History[K, int] = History(history_x, capacity_blocks)
        self._uses = 0
        self._age_every = AGE_X * capacity_blocks
        self._low = 1  # no non-empty bucket below this one

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def count(self, key: K) -> int:
        """The use count of a held key."""
        return self._count[key]

    def insert(self, key: K) -> None:
        c = min(MAX_COUNT, self._history.pop(key, 0) + 1)
        self._count[key] = c
        self._buckets[c][key] = None
        if c < self._low:
            self._low = c
        self._used()

    def access(self, key: K) -> None:
        c = self._count[key]
        if c < MAX_COUNT:
            del self._buckets[c][key]
            self._count[key] = c + 1
            self._buckets[c + 1][key] = None
        else:
            self._buckets[c].move_to_end(key)
        self._used()

    def refresh(self, key: K) -> None:
        self._buckets[self._count[key]].move_to_end(key)

    def remove(self, key: K) -> None:
        c = self._count.pop(key)
        del self._buckets[c][key]
        self._history.remember(key, c)

    def pop(self) -> K:
        if not self._count:
            raise IndexError("pop from an empty LFU policy")
        while not self._buckets[self._low]:
            self._low += 1
        key = self._buckets[self._low].popitem(last=False)[0]
        c = self._count.pop(key)
        self._history.remember(key, c)
        return key

    def restore(self, key: K) -> None:
        c = self._history.pop(key)
        self._count[key] = c
        self._buckets[c][key] = None
        self._buckets[c].move_to_end(key, last=False)
        self._low = min(self._low, c)

    def deprioritize(self, key: K) -> None:
        """Count 1, oldest of the lowest bucket; its history forgotten."""
        c = self._count[key]
        del self._buckets[c][key]
        self._count[key] = 1
        self._buckets[1][key] = None
        self._buckets[1].move_to_end(key, last=False)
        self._low = 1

    def _used(self) -> None:
        self._uses += 1
        if self._uses >= self._age_every:
            self._age()

    def _age(self) -> None:
        """Halve every count (at least 1 for held keys; forgotten at 0 in the history)."""
        self._uses = 0
        old, self._buckets = self._buckets, [OrderedDict() for _ in range(MAX_COUNT + 1)]
        for c, bucket in enumerate(old):
            half = max(1, c // 2)
            for key in bucket:
                self._count[key] = half
                self._buckets[half][key] = None
        aged = [(k, c // 2) for k, c in self._history.items() if c >= 2]
        self._history.clear()
        self._history.update(aged)
        self._low = 1

    def order(self) -> Iterator[K]:
        return itertools.chain.from_iterable(self._buckets)

    def histories(self) -> tuple[History[K, int], ...]:
        return (self._history,)

    def clear(self) -> None:
        self._count.clear()
        self._history.clear()
        for bucket in self._buckets:
            bucket.clear()
        self._uses = 0
        self._low = 1

    def check_integrity(self) -> None:
        if sum(len(b) for b in self._buckets) != len(self._count) or self._buckets[0]:
            raise RuntimeError("LFU: the buckets do not hold exactly the counted keys (a bug)")
        for c, bucket in enumerate(self._buckets):
            if any(self._count.get(k) != c for k in bucket):
                raise RuntimeError(f"LFU: a key in bucket {c} has another count (a bug)")
            if bucket and c < self._low:
                raise RuntimeError("LFU: a non-empty bucket lies below the lowest mark (a bug)")
        if self._history.keys() & self._count.keys():
            raise RuntimeError("LFU: a held key is also in the history (a bug)")


@register_eviction("lfu")
@dataclass(frozen=True)
class LFUConfig(EvictionConfig):
    """LFU: `history_x` is the counts of evicted keys remembered, in tier capacities."""

    history_x: float = ratio_field(HISTORY_X)

    def make(self, capacity_blocks: int) -> EvictionPolicy[Any]:
        return LFUPolicy(capacity_blocks, history_x=self.history_x)
