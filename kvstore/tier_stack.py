"""The tier stack: the one place that moves bytes between tiers.

Tiers are independent (none holds another); the stack hands each the `Below` view of the tier
under it, and decides everything between them: where a lookup is served from (`locate`),
copying blocks out (`load`), writing new blocks (`put`: into the top tier, and at once into
shared tiers, and persistent ones with write-through), promotion of lower-tier hits into the
top tier, prefetching slow tiers into memory, pinning, clearing, scrubbing, and spilling down
on shutdown. What a tier is comes from its traits, never its kind. Callers hold the store's
lock, except for `read_prefetch`. Every call that can change a tier ends by publishing the
tiers' changes (`changes`, `kvstore/change_feed.py`), in the order they happened.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Container, Sequence
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

import torch

from kvstore.change_feed import ChangeFeed
from kvstore.results import ClearResult
from kvstore.verify import VerifyBound, VerifyResult, verify_blocks
from tiers.base import ScrubResult, Tier
from tiers.changes import ChangeKind, TierChange
from tiers.errors import DiskFullError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.shared.blockbatch import take

logger = logging.getLogger(__name__)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _publishes(method: Callable[Concatenate[TierStack, _P], _R]) -> Callable[Concatenate[TierStack, _P], _R]:
    """A `TierStack` call that publishes the tiers' changes when it ends, however it ends."""
    def call(self: TierStack, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.changes.publish()

    functools.update_wrapper(call, method)
    return call


class _Below:
    """What `upper` sees of the stack below it: `lower`, and the feed that takes both tiers'
    changes around each demotion (so they stay in the order they happened)."""

    def __init__(self, upper: Tier, lower: Tier, feed: ChangeFeed) -> None:
        self._upper, self._lower, self._feed = upper, lower, feed
        # Blocks the running `TierStack.put` writes into `lower` itself: not demoted twice.
        self.skip: frozenset[BlockHash] = frozenset()

    def demote(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        if self.skip:
            keep = [i for i, k in enumerate(keys) if k.block_hash not in self.skip]
            if len(keep) < len(keys):
                keys, srcs = [keys[i] for i in keep], take(srcs, keep)
            if not keys:
                return 0
        self._feed.collect(self._upper)  # what the upper tier did before this demotion
        try:
            return self._lower.put(keys, srcs)
        finally:
            self._feed.collect(self._lower)  # before the upper tier records the blocks leaving it

    def holds(self, block_hash: BlockHash) -> bool:
        return self._lower.match_prefix([block_hash]) == 1


class Prefetch(NamedTuple):
    """A prefetch's plan: the prefix positions to read, the index of the tier each comes
    from, the memory tier they go to; the held prefix's length, how many of its blocks memory
    tiers hold already, how many more there were than the memory tier has room for, and how
    many other running prefetches are reading already."""

    positions: list[int]
    sources: list[int]
    target: int
    num_held: int = 0
    num_already: int = 0
    num_unfit: int = 0
    num_in_flight: int = 0


class TierStack:
    """Ordered tiers, fastest first, and the policy between them.

    Invariant: a block is written only through `put`, `promote` or a tier's own demotion
    into the next tier down; never from a lower tier into a higher one except by `promote`.
    Every change a call makes to a tier reaches `changes`' sinks before the call returns.
    """

    def __init__(self, tiers: Sequence[Tier], *, write_through: bool) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self.tiers = tuple(tiers)
        self._index = {t.kind: i for i, t in enumerate(self.tiers)}
        if len(self._index) != len(self.tiers):
            raise ValueError(f"two tiers of one kind in a stack: {[t.kind.value for t in self.tiers]}")
        self.write_through = write_through
        # Tiers below the top that every put reaches at once: a shared tier always (other
        # hosts read it), a persistent one with `write_through`.
        self._through = [t for t in self.tiers[1:]
                         if t.traits.shared or (write_through and t.traits.persistent)]
        self.changes = ChangeFeed(self.tiers)  # what entered and left the tiers, for its sinks
        self._belows: list[_Below] = []
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            upper.below = _Below(upper, lower, self.changes)
            self._belows.append(upper.below)
        self.num_promotion_failures = 0
        self.num_prefetched: dict[TierKind, int] = {}  # blocks prefetched into memory, by source tier
        # Told (tier kind, blocks, seconds) after each load from a tier below the pool.
        self.on_load: Callable[[TierKind, int, float], None] | None = None

    @property
    def top(self) -> Tier:
        return self.tiers[0]

    # -- reads -----------------------------------------------------------------------------
    def plan_lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Index of the fastest tier holding each block of the longest cached prefix.

        Each tier is asked once per run of consecutive blocks it holds (one LMDB read
        transaction per disk run), and only where no faster tier holds the block. Changes
        nothing.
        """
        return self._plan(hashes, ask_bottom=True)

    def plan_load(self, hashes: Sequence[BlockHash]) -> list[int]:
        """A plan for `load` when the destinations are already given: each block from the
        fastest tier above the bottom that holds it, else from the bottom tier, which is not
        asked beforehand (its read during `load` stops at the first block it lacks). So a
        load from disk opens one read transaction per disk run instead of two. Changes nothing."""
        return self._plan(hashes, ask_bottom=False)

    def _plan(self, hashes: Sequence[BlockHash], *, ask_bottom: bool) -> list[int]:
        asked = self.tiers if ask_bottom else self.tiers[:-1]
        plan: list[int] = []
        run_end = [0] * len(asked)
        for pos in range(len(hashes)):
            for index, tier in enumerate(asked):
                if run_end[index] <= pos:
                    run_end[index] = pos + tier.match_prefix(hashes, pos)
                if run_end[index] > pos:
                    plan.append(index)
                    break
            else:
                if ask_bottom:
                    break  # no tier holds this block: the prefix ends here
                plan.append(len(self.tiers) - 1)
        return plan

    @_publishes
    def load(
        self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor], plan: Sequence[int]
    ) -> tuple[int, dict[TierKind, int]]:
        """Copy block i of `keys` into `dsts[i]` from tier `plan[i]` (one `get_into` per run of
        one tier); stop at the first block missing or failing validation. Returns the blocks
        copied and how many each tier served."""

        def read(tier: Tier, start: int, end: int) -> int:
            t0 = time.perf_counter()
            got = tier.get_into(keys[start:end], dsts[start:end])
            if self.on_load is not None and not tier.traits.engine_memory:
                self.on_load(tier.kind, got, time.perf_counter() - t0)
            return got

        return self._read_runs(plan, read)

    def _read_runs(self, sources: Sequence[int], read: Callable[[Tier, int, int], int],
                   joins: Callable[[int, int], bool] | None = None,
                   stop: Callable[[], bool] | None = None) -> tuple[int, dict[TierKind, int]]:
        """Read blocks 0.. from tiers `sources[i]` in runs: block j joins the run that block i
        starts if it has i's tier (and `joins(i, j)`, when given); `read(tier, i, end)` reads
        one run and returns how many of its blocks it read, in order. Stops at the first run
        read short, or when `stop()`. Returns the blocks read and how many each tier gave."""
        counts: dict[TierKind, int] = {}
        done = 0
        while done < len(sources) and not (stop is not None and stop()):
            end = done + 1
            while end < len(sources) and sources[end] == sources[done] and (joins is None or joins(done, end)):
                end += 1
            tier = self.tiers[sources[done]]
            got = read(tier, done, end)
            if got:
                counts[tier.kind] = counts.get(tier.kind, 0) + got
            done += got
            if done < end:
                break
        return done, counts

    @_publishes
    def verify(self, keys: Sequence[BlockKey], computed: Sequence[torch.Tensor], unbounded: frozenset[TierKind],
               namespace: str, bound: VerifyBound) -> VerifyResult:
        """`kvstore/verify.py`'s check over every tier; its removals go out as changes."""
        return verify_blocks(self.tiers, unbounded, keys, computed, namespace, bound)

    @_publishes
    def discard(self, hashes: Sequence[BlockHash]) -> int:
        """Remove the blocks from every tier (pinned ones stay: their holder releases them);
        how many copies went."""
        return sum(tier.discard(hashes) for tier in self.tiers)

    # -- writes ----------------------------------------------------------------------------
    @_publishes
    def put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Write blocks (prefix order) into the top tier, tail first (a sequence's tail is
        evicted before its prefix); with write-through into the disk tier too, and always into
        a remote tier. Returns how many the top tier newly wrote. Raises `DiskFullError` if the
        local tiers cannot make room; the remote tier is written all the same.

        Each tier below the top gets these blocks once, from here: blocks of this call that
        overflow a tier above are not demoted into a tier this call writes through anyway
        (which would send a remote tier the same records twice, the overflow first). Every
        tier gets them tail first; the remote tier sends them parents first.
        """
        if not keys:
            return 0
        order_keys, order_srcs = keys[::-1], srcs[::-1]
        through = {id(t) for t in self._through}
        written = 0
        try:
            hashes = frozenset(k.block_hash for k in keys)
            for below, lower in zip(self._belows, self.tiers[1:]):
                below.skip = hashes if id(lower) in through else frozenset()
            try:
                written = self.top.put(order_keys, order_srcs)
            finally:
                for below in self._belows:
                    below.skip = frozenset()
            for tier in self._through:
                if not tier.traits.shared:
                    tier.put(order_keys, order_srcs)
        finally:  # other hosts read a shared tier: a full local disk does not keep it from them
            for tier in self._through:
                if tier.traits.shared:
                    tier.put(order_keys, order_srcs)
        return written

    @_publishes
    def flush(self) -> bool:
        """Wait until writes queued for tiers that write in the background are done; False
        if one timed out."""
        return all(tier.flush() for tier in self.tiers)

    @_publishes
    def promote(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor], plan: Sequence[int],
                num_ok: int) -> None:
        """Copy the lower-tier hits among the first `num_ok` blocks into the top tier, prefix
        first, without evicting this request's own top-tier blocks; then make the whole
        prefix most recently used. `srcs[i]` must hold exactly block i's validated bytes."""
        top = self.top
        budget = top.capacity_blocks - sum(1 for i in range(num_ok) if plan[i] == 0)
        lower = [i for i in range(num_ok) if plan[i] != 0][: max(0, budget)]
        try:
            if lower:
                order = lower[::-1]
                top.put([keys[i] for i in order], take(srcs, order))
        except DiskFullError:
            self.num_promotion_failures += 1
        top.touch([k.block_hash for k in reversed(keys[:num_ok])])

    def pin(self, kind: TierKind, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Pin the given blocks in tier `kind`; return exactly those pinned (a block gone
        meanwhile is skipped, and those after it are still pinned)."""
        tier = self.tier(kind)
        return [h for h in hashes if tier.pin([h])]

    def unpin(self, kind: TierKind, hashes: Sequence[BlockHash]) -> None:
        self.tier(kind).unpin(hashes)

    def tier(self, kind: TierKind) -> Tier:
        """The tier of `kind`; `KeyError` if the stack has none."""
        return self.tiers[self._index[kind]]

    # -- prefetch: slow tiers into memory ----------------------------------------------------
    def plan_prefetch(self, hashes: Sequence[BlockHash], reserved: int = 0,
                      in_flight: Container[BlockHash] = frozenset()) -> Prefetch | None:
        """Which blocks of the cached prefix to read from tiers outside memory, and into which
        memory tier (the slowest one); None if no tier is memory. Skips the blocks in
        `in_flight` (other running prefetches read them), and plans no more than that tier
        can take beside `reserved` blocks (retained ones and those other prefetches read) and
        the prefix's blocks it holds already, so the insert never evicts those. Changes nothing."""
        memory = [i for i, t in enumerate(self.tiers) if t.traits.memory]
        if not memory:
            return None
        plan = self.plan_lookup(hashes)
        outside = [p for p, t in enumerate(plan) if not self.tiers[t].traits.memory]
        fetch = [p for p in outside if hashes[p] not in in_flight]
        already = len(plan) - len(outside)
        room = max(0, self.tiers[memory[-1]].capacity_blocks - reserved - already)
        unfit = max(0, len(fetch) - room)
        fetch = fetch[:room]
        return Prefetch(fetch, [plan[p] for p in fetch], memory[-1], len(plan), already, unfit,
                        len(outside) - len(fetch) - unfit)

    @_publishes
    def read_prefetch(self, keys: Sequence[BlockKey], prefetch: Prefetch, buffer: Sequence[torch.Tensor],
                      stop: Callable[[], bool]) -> tuple[int, dict[TierKind, int]]:
        """Read the planned blocks into `buffer`, one read per run of one tier, in prefix order,
        until a block is missing or `stop()`; runs without the store's lock. Returns the blocks
        read and how many each tier gave."""
        fetch = prefetch.positions
        return self._read_runs(prefetch.sources,
                               lambda tier, i, end: tier.get_into([keys[p] for p in fetch[i:end]], buffer[i:end]),
                               joins=lambda i, j: fetch[j] - fetch[i] == j - i, stop=stop)

    @_publishes
    def insert_prefetched(self, keys: Sequence[BlockKey], prefetch: Prefetch, buffer: Sequence[torch.Tensor],
                          num_read: int, counts: dict[TierKind, int]) -> bool:
        """Put the first `num_read` prefetched blocks into the plan's memory tier and count
        them (`num_prefetched`, by the tier `counts` says they came from); False if a full
        tier below refused what the insert would evict (then nothing moved)."""
        order = list(range(num_read - 1, -1, -1))  # eviction order: the tail first
        try:
            self.tiers[prefetch.target].put([keys[prefetch.positions[i]] for i in order], take(buffer, order))
        except DiskFullError:
            return False
        for kind, n in counts.items():
            self.num_prefetched[kind] = self.num_prefetched.get(kind, 0) + n
        return True

    def leading_in_memory(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the cached prefix memory tiers hold now."""
        plan = self.plan_lookup(hashes)
        return next((i for i, t in enumerate(plan) if not self.tiers[t].traits.memory), len(plan))

    # -- housekeeping ------------------------------------------------------------------------
    @_publishes
    def clear(self, *, all_namespaces: bool = False) -> ClearResult:
        """Delete this namespace's blocks from every tier (with `all_namespaces`, every block
        kvstrata wrote in the tiers several namespaces share); each tier's changes end with a
        `CLEARED`. Returns whether every tier's sweep finished, and how many keys they
        deleted (`Tier.sweep`: a server's tier counts them)."""
        complete, deleted = True, 0
        for tier in self.tiers:
            swept = tier.sweep(all_namespaces=all_namespaces)
            complete, deleted = complete and swept.complete, deleted + swept.num_deleted
            self.changes.collect(tier)
            self.changes.add(TierChange(tier.kind, ChangeKind.CLEARED, ()))
        return ClearResult(complete, deleted)

    @_publishes
    def scrub(self) -> ScrubResult | None:
        """Validate every block of the tiers that keep checks; delete the damaged ones. The
        counts of all such tiers together; None if no tier scrubs."""
        results = [r for r in (tier.scrub() for tier in self.tiers) if r is not None]
        if not results:
            return None
        return ScrubResult(*(sum(field) for field in zip(*results)))

    # -- lifecycle -------------------------------------------------------------------------
    @_publishes
    def spill(self) -> tuple[int, int]:
        """Copy every tier's blocks one tier down, fastest first (the pool into the CPU tier,
        then the CPU tier to disk). Returns (blocks written, blocks a full tier refused);
        never raises for a full disk."""
        spilled = refused = 0
        for tier in self.tiers:
            before = tier.num_spill_refused
            try:
                spilled += tier.spill()
            except DiskFullError as exc:
                logger.warning("kvstrata: could not persist %s blocks: %s", tier.kind.value, exc)
                refused += len(tier)
            refused += tier.num_spill_refused - before
        return spilled, refused

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    @_publishes
    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
