"""S3-FIFO (Yang et al., SOSP'23): quick demotion of blocks used once, FIFO queues only."""

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

MAX_FREQ = 3  # uses counted per key (2 bits in the paper)
SMALL_SHARE = 0.1  # the small queue's share of the tier
GHOST_X = 4.0  # ghost entries, in tier capacities (the paper: one main queue; 4x measured better here)


class S3FIFOPolicy(EvictionPolicy[K]):
    """A small FIFO for new keys, a main FIFO for keys used again, a ghost FIFO of keys the
    small queue evicted.

    New keys enter the small queue (or the main one, if their ghost is remembered). Leaving
    the small queue, a key used since its insertion moves to the main queue; one that was not
    is evicted and becomes a ghost. Leaving the main queue, a key used since it last passed
    is reinserted with one use less; one that was not is evicted.

    A deprioritized (low-priority) key waits in a cold queue that `pop` empties first; a use
    sends it to the small queue as a new key.

    Invariant: every held key is in exactly one of the cold, small and main queues and has a
    use count in [0, MAX_FREQ]; no held key is a ghost.
    """

    kind = EvictionKind.S3FIFO

    def __init__(self, capacity_blocks: int, *, small_share: float = SMALL_SHARE, ghost_x: float = GHOST_X) -> None:
        super().__init__(capacity_blocks)
        self._small_limit = max(1, int(capacity_blocks * small_share))
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: History[K, None] = History(ghost_x, capacity_blocks)
        self._cold: ColdQueue[K] = ColdQueue(self._ghost.limit)  # low-priority keys, popped first
        self._freq: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def insert(self, key: K) -> None:
        self._freq[key] = 0
        self._cold.forget(key)  # returns as new
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def access(self, key: K) -> None:
        if self._cold and key in self._cold:
            self._warm(key)
        f = self._freq[key]
        if f < MAX_FREQ:
            self._freq[key] = f + 1

    def refresh(self, key: K) -> None:
        if key not in self._freq:
            raise KeyError(key)
        if self._cold and key in self._cold:
            self._warm(key)

    def remove(self, key: K) -> None:
        del self._freq[key]
        delete_from(key, self._small, self._main, self._cold)

    def pop(self) -> K:
        small, main, freq = self._small, self._main, self._freq
        if not freq:
            raise IndexError("pop from an empty S3-FIFO policy")
        if self._cold:
            key = self._cold.pop_front(len(freq))
            del freq[key]  # no ghost: a low-priority key returns as new
            return key
        while True:
            if small and (len(small) >= self._small_limit or not main):
                key = small.popitem(last=False)[0]
                if freq[key]:
                    freq[key] = 0
                    main[key] = None
                    continue
                del freq[key]
                self._ghost.remember(key, None)
                return key
            key = main.popitem(last=False)[0]
            f = freq[key]
            if f:
                freq[key] = f - 1
                main[key] = None
                continue
            del freq[key]
            return key

    def restore(self, key: K) -> None:
        self._freq[key] = 0
        if self._cold.unpop(key):
            return
        if key in self._ghost:  # the small queue evicted it; the main queue leaves no ghost
            del self._ghost[key]
            queue = self._small
        else:
            queue = self._main
        queue[key] = None
        queue.move_to_end(key, last=False)

    def deprioritize(self, key: K) -> None:
        """No uses, at the front of the cold queue, which `pop` empties before the others."""
        self.remove(key)
        self._freq[key] = 0
        self._cold.push_front(key)

    def _warm(self, key: K) -> None:
        """A used cold key leaves the cold queue for the small one, as a new key."""
        del self._cold[key]
        self._small[key] = None

    def order(self) -> Iterator[K]:
        return itertools.chain(self._cold, self._small, self._main)

    def histories(self) -> tuple[History[K, None], ...]:
        return (self._ghost,)

    def clear(self) -> None:
        for d in (self._small, self._main, self._ghost, self._cold, self._freq):
            d.clear()

    def check_integrity(self) -> None:
        small, main, cold = self._small.keys(), self._main.keys(), self._cold.keys()
        if small & main or cold & (small | main) or len(small) + len(main) + len(cold) != len(self._freq) \
                or (small | main | cold) != self._freq.keys():
            raise RuntimeError("S3-FIFO: the cold, small and main queues do not partition the held keys (a bug)")
        if self._ghost.keys() & self._freq.keys():
            raise RuntimeError("S3-FIFO: a held key is also a ghost (a bug)")
        self._cold.check_integrity(self._freq.keys(), "S3-FIFO")
        if any(not 0 <= f <= MAX_FREQ for f in self._freq.values()):
            raise RuntimeError("S3-FIFO: a use count is out of range (a bug)")


@register_eviction("s3fifo")
@dataclass(frozen=True)
class S3FIFOConfig(EvictionConfig):
    """S3-FIFO: `small_share` is the small queue's share of the tier, in (0, 1); `ghost_x` the
    ghost entries kept, in tier capacities."""

    small_share: float = ratio_field(SMALL_SHARE, upper=1.0)
    ghost_x: float = ratio_field(GHOST_X)

    def make(self, capacity_blocks: int) -> EvictionPolicy[Any]:
        return S3FIFOPolicy(capacity_blocks, small_share=self.small_share, ghost_x=self.ghost_x)
