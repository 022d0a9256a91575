"""What entered and left a tier: the changes each tier records and the tier stack drains.

A tier never calls up to say what it did: it records each change in its own bounded
`ChangeLog`, and whoever holds the tier (the store's tier stack) takes them with
`Tier.take_changes()` and hands them on (to the KV-event publisher, to an engine). A log
records from the first take on: a tier nobody asks (a tier used on its own) keeps nothing.
Nothing is recorded twice and nothing is lost silently: a log that is not drained stops at
`max_keys` blocks, forgets what it held (counted in `num_dropped`) and says so with a
`RESYNC` change at the head of the next take.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from tiers.errors import KVStoreError
from tiers.keys import BlockKey, TierKind
from tiers.shared.forks import renew_in_child

logger = logging.getLogger(__name__)

MAX_CHANGED_KEYS = 1 << 18  # blocks a tier's log holds before it overflows (nobody drained it)


class ChangeKind(enum.Enum):
    """What a `TierChange` says of its blocks."""

    ENTERED = "entered"  # stored in the tier (a put, a promotion, a demotion from above)
    LEFT = "left"  # gone from it (evicted, demoted, discarded, found damaged)
    CLEARED = "cleared"  # the tier was emptied (recorded by the tier stack's `clear`); no keys
    RESYNC = "resync"  # changes were lost (the log overflowed): the tier holds `keys` now, as far as it can tell


class TierChange(NamedTuple):
    """One change of one tier's contents. `keys` are as complete as the tier knows them:
    entered blocks carry what the tier was given (token ids, parent, extras), left ones at
    least their hash."""

    tier: TierKind
    kind: ChangeKind
    keys: Sequence[BlockKey]


class ChangeLog:
    """A tier's recorded changes, oldest first, bounded; safe to record from one thread (a
    tier's background writer) while another takes.

    Invariant: `num_keys` is the number of keys the held changes carry, at most `max_keys`
    (a single change larger than that is never held: it overflows the log at once); nothing
    is held before the first `take`. On overflow every held change is dropped (counted in
    `num_dropped`, in blocks) and `overflowed` is set until the next `take`; changes recorded
    after it are kept.
    """

    def __init__(self, max_keys: int | None = None) -> None:
        max_keys = MAX_CHANGED_KEYS if max_keys is None else max_keys
        if max_keys <= 0:
            raise ValueError(f"a change log needs room for at least one key, got {max_keys}")
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._changes: list[TierChange] = []
        self.num_keys = 0
        self.num_dropped = 0
        self._overflowed = False
        self._taken = False  # someone takes the changes: record them
        renew_in_child(self, "_lock")

    def record(self, change: TierChange) -> None:
        """Append `change` (nothing before the first `take`); on overflow drop it and
        everything held (see the class)."""
        if not self._taken:
            return
        n = len(change.keys)
        with self._lock:
            if self.num_keys + n > self.max_keys:
                self.num_dropped += self.num_keys + n
                self._changes, self.num_keys, self._overflowed = [], 0, True
                return
            self._changes.append(change)
            self.num_keys += n

    def take(self, tier: TierKind, held_keys: Callable[[], Iterable[BlockKey]]) -> list[TierChange]:
        """Every held change, oldest first; the log is empty afterwards. If changes were
        dropped before them, a `RESYNC` of tier `tier` comes first, with `held_keys()` (none
        if that raises: the tier closed meanwhile, or its medium failed, which is logged)."""
        self._taken = True
        if not self._changes and not self._overflowed:  # nothing to take (a racing record: the next take)
            return []
        with self._lock:
            changes, overflowed = self._changes, self._overflowed
            self._changes, self.num_keys, self._overflowed = [], 0, False
        if not overflowed:
            return changes
        try:
            held = list(held_keys())
        except Exception as exc:
            if not isinstance(exc, KVStoreError):
                logger.warning("kvstrata: %s tier: its keys could not be listed after its change log overflowed "
                               "(%s: %s)", tier.value, type(exc).__name__, exc)
            held = []
        return [TierChange(tier, ChangeKind.RESYNC, held), *changes]
