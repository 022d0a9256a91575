"""`EventLog`: the block changes of a store's tiers, buffered for the engine API's `take_events`.

It records nothing until `start` (the first `take_events`): from then on it is a sink of the
tier stack's change feed (beside the KV-event publisher, if there is one), which hands it what
entered and left each tier, in order. The buffer
is bounded by blocks: when full, the oldest changes are dropped, counted and warned about
once per drain, and the next `take` says how many were lost.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

from kvstore.change_feed import ChangeFeed
from kvstore.engine_api import BlockChange, BlockEvent, EventBatch
from tiers.changes import ChangeKind, TierChange

logger = logging.getLogger(__name__)
MAX_BUFFERED_BLOCKS = 1 << 18

_CHANGE = {ChangeKind.ENTERED: BlockChange.STORED, ChangeKind.LEFT: BlockChange.REMOVED}


class EventLog:
    """Changes in arrival order. Thread-safe (tiers report from any thread, under their own
    locks or the store's); never blocks a tier beyond its own short lock and never raises.

    Invariant: `_num_blocks` is the number of block hashes (one for a clear) in `_events`,
    at most `max_blocks`.
    """

    def __init__(self, max_blocks: int = MAX_BUFFERED_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._events: deque[BlockEvent] = deque()
        self._num_blocks = 0
        self._num_dropped = 0  # blocks' changes dropped since the last take
        self.started = False

    def start(self, feed: ChangeFeed) -> None:
        """Begin recording every change `feed` publishes. Idempotent."""
        if self.started:
            return
        feed.add_sink(self.on_changes)
        self.started = True

    def on_changes(self, changes: Sequence[TierChange]) -> None:
        """Record `changes`, in order: entered blocks as stored, left ones as removed, a
        cleared tier as cleared, and a tier restated after its log overflowed as cleared, then
        storing what it holds."""
        for change in changes:
            hashes = tuple(k.block_hash for k in change.keys)
            if change.kind in (ChangeKind.CLEARED, ChangeKind.RESYNC):
                self._add(BlockEvent(BlockChange.CLEARED, change.tier, ()))
                if change.kind is ChangeKind.RESYNC and hashes:
                    self._add(BlockEvent(BlockChange.STORED, change.tier, hashes))
            elif hashes:
                self._add(BlockEvent(_CHANGE[change.kind], change.tier, hashes))

    def _add(self, event: BlockEvent) -> None:
        size = max(1, len(event.block_hashes))
        with self._lock:
            warn = False
            while self._events and self._num_blocks + size > self.max_blocks:
                old = self._events.popleft()
                dropped = max(1, len(old.block_hashes))
                self._num_blocks -= dropped
                warn = warn or self._num_dropped == 0
                self._num_dropped += dropped
            if size > self.max_blocks:  # larger than the whole buffer: dropped itself
                warn = warn or self._num_dropped == 0
                self._num_dropped += size
            else:
                self._events.append(event)
                self._num_blocks += size
        if warn:
            logger.warning("kvstrata: the engine API's event buffer is full (%d blocks): the oldest changes are "
                           "dropped until the next take_events()", self.max_blocks)

    def take(self) -> EventBatch:
        """Every change recorded since the last call, oldest first, and how many blocks'
        changes were dropped meanwhile; empties the buffer."""
        with self._lock:
            events, self._events = list(self._events), deque()
            dropped, self._num_dropped, self._num_blocks = self._num_dropped, 0, 0
        return EventBatch(events, dropped)
