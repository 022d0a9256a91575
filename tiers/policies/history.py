"""What an eviction policy remembers of keys after they left it (ghosts, use counts): ordered
dicts, the oldest first, bounded in multiples of the tier's capacity."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def trim(ghosts: OrderedDict[K, V], limit: int) -> None:
    """Drop the oldest entries of a ghost list until at most `limit` remain."""
    while len(ghosts) > limit:
        ghosts.popitem(last=False)


class History(OrderedDict[K, V]):
    """Keys a policy of `capacity_blocks` blocks remembers after they left it, the oldest first:
    at most `x` tier capacities of them (`limit`), never more than for its own capacity."""

    def __init__(self, x: float, capacity_blocks: int) -> None:
        super().__init__()
        self.x = x
        self.capacity_blocks = capacity_blocks
        self.limit = self.limit_for(capacity_blocks)

    def limit_for(self, capacity_blocks: int) -> int:
        """The most entries it keeps for a tier of `capacity_blocks` blocks (at least 1)."""
        return max(1, int(min(capacity_blocks, self.capacity_blocks) * self.x))

    def remember(self, key: K, value: V) -> None:
        """Set `key`'s entry (a new key the newest); the oldest go past `limit`."""
        self[key] = value
        while len(self) > self.limit:  # `trim`, inline: once per eviction
            self.popitem(last=False)

    def trim_to(self, capacity_blocks: int) -> None:
        """Forget the oldest entries beyond `limit_for(capacity_blocks)`."""
        trim(self, self.limit_for(capacity_blocks))
