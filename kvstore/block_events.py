"""`EventLog`: the block changes of a store's tiers, buffered for the engine API's `take_events`.

It records nothing until `start` (the first `take_events`): from then on every tier tells it,
beside the KV-event publisher if there is one, which blocks entered and left it. The buffer
is bounded by blocks: when full, the oldest changes are dropped, counted and warned about
once per drain, and the next `take` says how many were lost.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from kvstore.engine_api import BlockChange, BlockEvent, EventBatch
from tiers.base import BlockKey, Tier, TierKind

logger = logging.getLogger(__name__)
MAX_BUFFERED_BLOCKS = 1 << 18

Listener = Callable[[TierKind, bool, Sequence[BlockKey]], None]


def _both(first: Listener, second: Listener) -> Listener:
    def tell(kind: TierKind, stored: bool, keys: Sequence[BlockKey]) -> None:
        first(kind, stored, keys)
        second(kind, stored, keys)

    return tell


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

    def start(self, tiers: Sequence[Tier]) -> None:
        """Begin recording every change of `tiers` (call with the store's lock held: the
        listeners are swapped in while no store call runs). Idempotent."""
        if self.started:
            return
        for tier in tiers:
            tier.listener = self.on_change if tier.listener is None else _both(tier.listener, self.on_change)
        self.started = True

    def on_change(self, kind: TierKind, stored: bool, keys: Sequence[BlockKey]) -> None:
        """Record that `keys` entered (`stored`) or left tier `kind`."""
        if keys:
            change = BlockChange.STORED if stored else BlockChange.REMOVED
            self._add(BlockEvent(change, kind, tuple(k.block_hash for k in keys)))

    def on_clear(self, kind: TierKind) -> None:
        """Record that tier `kind` lost every block of the store (only once started)."""
        if self.started:
            self._add(BlockEvent(BlockChange.CLEARED, kind, ()))

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
