"""The shared-filesystem tier's writes in flight per block, so a discard is never undone by one.

A `put` waits for its writes up to the tier's timeout; one still running past it (a slow or
hung mount) may rename its file into place after a `discard` of the same block removed it,
putting back a block verify quarantined. The tier counts each block's writes from submission
to their end; a discard marks the blocks with writes in flight, and the last of those writes
to end removes the file it wrote again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from tiers.keys import BlockHash
from tiers.shared.forks import renew_in_child


class WritesInFlight:
    """Blocks with writes submitted and not ended (how many each), and those of them
    discarded meanwhile. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[BlockHash, int] = {}
        self._doomed: set[BlockHash] = set()
        renew_in_child(self, "_lock")

    def _after_fork(self) -> None:
        """In a forked child: no writes in flight (the parent's threads, and the writes they
        ran, do not exist here)."""
        self._count, self._doomed = {}, set()

    def start(self, h: BlockHash) -> None:
        """One more write of `h` submitted."""
        with self._lock:
            self._count[h] = self._count.get(h, 0) + 1

    def doom(self, hashes: Iterable[BlockHash]) -> None:
        """`hashes` were discarded: those with writes in flight are to be removed again."""
        with self._lock:
            self._doomed.update(h for h in hashes if h in self._count)

    def end(self, h: BlockHash) -> bool:
        """A write of `h` ended (or was cancelled); whether its file must be removed again: `h`
        was discarded while it was in flight and no other write of it is."""
        with self._lock:
            left = self._count.pop(h) - 1
            if left:
                self._count[h] = left
                return False
            if h in self._doomed:
                self._doomed.discard(h)
                return True
            return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._count)
