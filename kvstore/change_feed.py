"""`ChangeFeed`: the tiers' changes, taken in the order they happened, handed to sinks.

Tiers record what entered and left them (`Tier.take_changes`, `tiers/changes.py`); no tier
calls up. The tier stack takes the changes around every demotion (the upper tier's before the
lower tier writes, the lower tier's right after: a demoted block enters the lower tier before
it leaves the upper one, as it happened) and, after every operation that can change a tier,
publishes: every tier's remaining changes, fastest tier first, go after those taken before,
to every sink, in order. A sink is the KV-event publisher (`EventPublisher.publish`) when the
store publishes, or an engine's buffer. What tiers do in the background (the remote tier's
writer) goes out with the next operation, or with any `publish()` before it: the event
publisher calls it every 20 ms.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from tiers.base import Tier
from tiers.changes import TierChange
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)

Sink = Callable[[Sequence[TierChange]], None]
"""Takes changes in the order they happened; called under the feed's lock, from any thread
that publishes: it must not block, nor call back into the feed or the tier stack."""

class ChangeFeed:
    """The changes of one stack's tiers on their way to the sinks.

    Invariant: every change in `_pending` happened before every change still in a tier's log
    (the stack takes a lower tier's changes into it before the upper tier records more), and
    sinks get each change once, oldest first. With no sink, changes are taken and dropped.
    """

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tuple(tiers)
        self._lock = threading.Lock()
        self._pending = [c for tier in self._tiers for c in tier.take_changes()]  # the tiers record from now on
        self._sinks: list[Sink] = []
        self.num_sink_errors = 0  # sink calls that raised (logged, at most once a minute)
        self._warn = RateLimitedWarning(logger, every_s=60.0)

    def add_sink(self, sink: Sink) -> None:
        """Hand every change published from now on to `sink` too (after the sinks added
        before it)."""
        with self._lock:
            self._sinks.append(sink)

    def remove_sink(self, sink: Sink) -> None:
        """Stop handing changes to `sink` (nothing if it was not added)."""
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    def collect(self, tier: Tier) -> None:
        """Take `tier`'s recorded changes into the feed, after those taken before."""
        with self._lock:
            self._pending.extend(tier.take_changes())

    def add(self, change: TierChange) -> None:
        """Append a change the stack itself knows of (a tier it cleared)."""
        with self._lock:
            self._pending.append(change)

    def publish(self) -> None:
        """Take every tier's changes (fastest tier first, after those the feed holds) and hand
        them all to each sink. Safe from any thread; never raises for a sink."""
        with self._lock:
            changes = self._pending
            self._pending = []
            for tier in self._tiers:
                changes.extend(tier.take_changes())
            if not changes:
                return
            for sink in self._sinks:
                try:
                    sink(changes)
                except Exception as exc:  # a sink's fault never reaches the store's caller
                    self.num_sink_errors += 1
                    self._warn(f"a tier-change sink failed ({type(exc).__name__}: {exc}); "
                               f"{self.num_sink_errors} failures so far")
