"""What a `prefetch` did (`PrefetchResult`), and the bound on prefetches waiting to run.

A prefetch is a hint: an engine or a control endpoint asks for it so that a request arriving
later finds its prefix in memory. It must never block its caller nor pile up work, so each
call reads at most `MAX_PREFETCH_BLOCKS` blocks (or the caller's smaller `max_blocks`), never
more than the memory tier can take beside its retained blocks and the blocks other running
prefetches will insert (so their buffers together stay within that tier's size), and at most
`PREFETCH_QUEUE_PER_THREAD` prefetches per I/O thread wait or run at once: one more is
dropped and counted (`PrefetchStatus.DROPPED`), its future already resolved.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from kvstore.errors import InvalidInputError

MAX_PREFETCH_BLOCKS = 4096  # blocks one prefetch call looks at, at most
PREFETCH_QUEUE_PER_THREAD = 16  # prefetches waiting or running per I/O thread, at most


class PrefetchStatus(enum.Enum):
    """How a prefetch ended."""

    DONE = "done"  # ran: `num_promoted` blocks moved (0 if memory held the prefix already)
    DROPPED = "dropped"  # too many prefetches waiting: not run (counted)
    CLOSED = "closed"  # `close()` found it waiting or running: nothing moved
    CLEARED = "cleared"  # `clear()` ran during its reads: nothing inserted
    QUARANTINED = "quarantined"  # verify removed blocks during its reads: nothing inserted
    FULL = "full"  # the memory tier's insert would evict into a full tier below: nothing inserted
    FAULT = "fault"  # a tier failed while it read: what was read before is inserted (counted)


class PrefetchResult(NamedTuple):
    """What a prefetch did, in blocks of the keys asked (prefix order).

    Attributes:
        status: how it ended (`PrefetchStatus`).
        num_held: the longest prefix some tier held when it ran.
        num_already: blocks of that prefix memory tiers held already (nothing to move).
        num_promoted: blocks it read from a slower tier (disk, remote, ...) into memory.
        num_failed: blocks it meant to read but could not (missing or damaged by the time it
            read them, or a fault): counted misses, never a hole (reads stop at the first).
        num_unfit: blocks of the held prefix past what the memory tier can take beside its
            retained blocks: not read.
        num_capped: keys past the per-call cap (`max_blocks`): not looked at.
        num_in_memory: leading blocks memory tiers held when it ended; a request for these
            keys now loads that many without touching a slow tier.
        num_in_flight: blocks of the held prefix another running prefetch was reading: not
            read twice (they reach memory when that one ends, unless its read fails); those of
            one a clear or a verify removal voided are read again, not counted here.
    """

    status: PrefetchStatus
    num_held: int = 0
    num_already: int = 0
    num_promoted: int = 0
    num_failed: int = 0
    num_unfit: int = 0
    num_capped: int = 0
    num_in_memory: int = 0
    num_in_flight: int = 0


def check_max_blocks(max_blocks: object) -> int:
    """The per-call cap: `max_blocks` (an int in 1..MAX_PREFETCH_BLOCKS) or the default;
    `InvalidInputError` naming a bad value."""
    if max_blocks is None:
        return MAX_PREFETCH_BLOCKS
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or not 1 <= max_blocks <= MAX_PREFETCH_BLOCKS:
        raise InvalidInputError(f"prefetch max_blocks must be an int in [1, {MAX_PREFETCH_BLOCKS}] or None, "
                                f"got {max_blocks!r}")
    return max_blocks
