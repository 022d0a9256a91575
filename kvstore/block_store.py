"""`TierBlockStore`: the engine API (`engine_api.BlockStore`) over one store's tier stack.

Its one job is moving whole blocks by key between an engine and the tiers: it validates the
keys and tensors, takes the store's lock, asks `TierStack` (which places every byte) and
counts. It owns the store's generation (bumped by `clear`, which it also runs, so work begun
before a clear never brings its bytes back after it; a prefetch read before a verify removal
inserts nothing either) and the event log `take_events` drains. What it shares with
`KVCacheStore` (lock, counters, background work, whether the store is open) it is given at
construction; it reads nothing of the store's.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvstore.block_events import EventLog
from kvstore.config import StoreConfig
from kvstore.engine_api import BlockStore, Destinations, EventBatch, LoadResult, LookupResult, SaveResult
from kvstore.errors import InvalidInputError, StoreClosedError
from kvstore.keying import ChainKeys, key_hashes
from kvstore.lifecycle import Lifecycle
from kvstore.prefetch import PREFETCH_QUEUE_PER_THREAD, PrefetchResult, PrefetchStatus, check_max_blocks
from kvstore.priority import PriorityResult, parse_priority, prioritize
from kvstore.results import ClearResult, StoreCounters
from kvstore.retention import MAX_RETAIN_S, RetainResult, Retention
from kvstore.tier_stack import Prefetch, TierStack
from kvstore.timing import timed
from kvstore.validate import check_block_tensors
from kvstore.verify import VerifyResult, check_tolerance, store_bound
from tiers.keys import BlockHash, BlockKey
from tiers.shared.blockbatch import BlockBatch
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)


def check_keys(keys: object) -> Sequence[BlockKey]:
    """`keys` if it is a sequence of `BlockKey`s; `InvalidInputError` naming the first bad one."""
    if isinstance(keys, ChainKeys):
        return keys
    if isinstance(keys, (str, bytes, bytearray)) or not isinstance(keys, Sequence):
        raise InvalidInputError(f"block keys must be a sequence of BlockKey, got {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, BlockKey) or not isinstance(key.block_hash, bytes) or not key.block_hash \
                or not isinstance(key.tokens, bytes):
            raise InvalidInputError(f"block key {i} is not a BlockKey of KVCacheStore.keys or engine_keys: "
                                    f"{key!r:.80}")
    return keys


class TierBlockStore(BlockStore):
    """See the module docstring and `engine_api.BlockStore` for what each call does."""

    def __init__(self, config: StoreConfig, stack: TierStack, lock: threading.RLock, counters: StoreCounters,
                 work: Lifecycle, check_open: Callable[[], None]) -> None:
        self._config, self._stack, self._lock = config, stack, lock
        self.counters = counters
        self._work = work
        self._check_open = check_open
        self._events = EventLog()
        self.block_size = config.block_size
        self.generation = 0  # clear() calls so far
        self._quarantines = 0  # verify calls that removed blocks: a prefetch read before one inserts nothing
        memory = next((t for t in stack.tiers if t.traits.memory and not t.traits.engine_memory), None)
        budget = int(config.retain_share * memory.capacity_blocks) if memory is not None else 0
        self.retention = Retention(memory, budget)
        # Called with ("store" | "load", seconds) after each such call when set (the store's
        # `observe_latency` sets it too).
        self.observe_latency: Callable[[str, float], None] | None = None
        self._prefetch_limit = PREFETCH_QUEUE_PER_THREAD * config.io_threads  # prefetches waiting or running
        self._prefetches = threading.BoundedSemaphore(self._prefetch_limit)
        self._prefetch_planned = 0  # blocks running prefetches read into buffers: room they hold in memory
        # Those blocks' hashes, by the (generation, quarantines) their reads saw: no other prefetch
        # of that view reads them (one a clear or verify removal voided inserts nothing: not skipped).
        self._prefetch_reading: dict[tuple[int, int], Counter[BlockHash]] = {}
        self._warn = RateLimitedWarning(logger)

    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        self._check_open()
        hashes = key_hashes(check_keys(keys))
        with self._lock:
            self._check_open()
            self.counters.num_lookup_calls += 1
            tiers = self._stack.tiers
            return LookupResult([tiers[i].kind for i in self._stack.plan_lookup(hashes)])

    @timed("load")
    def load(self, keys: Sequence[BlockKey], destinations: Destinations) -> LoadResult:
        self._check_open()
        keys = check_keys(keys)
        given = not callable(destinations)
        if given:
            check_block_tensors(self._config, destinations, len(keys), destination=True)
        with self._lock:
            self._check_open()
            hashes = key_hashes(keys)
            # Given destinations, the slowest tier is read without a lookup first (one round
            # trip to a remote server, one transaction on disk); else the hit sizes them.
            plan = self._stack.plan_load(hashes) if given else self._stack.plan_lookup(hashes)
            if plan and callable(destinations):
                destinations = destinations(len(plan))
                check_block_tensors(self._config, destinations, len(plan), destination=True)
            c = self.counters
            c.num_retrieve_calls += 1
            c.num_tokens_requested += len(keys) * self.block_size
            if not plan:
                return LoadResult(0, {})
            assert not callable(destinations)
            built = list(keys[: len(plan)])
            num_ok, counts = self._stack.load(built, destinations, plan)
            self._stack.promote(built, destinations, plan, num_ok)
            c.num_tokens_hit += num_ok * self.block_size
            return LoadResult(num_ok, counts)

    @timed("store")
    def save(self, keys: Sequence[BlockKey], sources: Sequence[torch.Tensor], *,
             generation: int | None = None) -> SaveResult:
        self._check_open()
        keys = check_keys(keys)
        check_block_tensors(self._config, sources, len(keys))
        with self._lock:
            self._check_open()
            current = self._current(generation)  # raises for a bad value before anything counts
            self.counters.num_store_calls += 1
            if not current:
                return SaveResult(0, 0)
            if len(self.retention):
                self.retention.expire()
            written = self._stack.put(list(keys), sources)
            self.counters.num_blocks_stored += written
            if len(keys) <= self._stack.top.capacity_blocks:
                return SaveResult(written, len(keys))  # the top tier took every block (no second lookup)
            return SaveResult(written, len(self._stack.plan_lookup(key_hashes(keys))))  # some may be gone

    def _current(self, generation: int | None) -> bool:
        """Whether KV produced at `generation` may be stored now (call with the lock held)."""
        if generation is None:
            return True
        if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation <= self.generation:
            raise InvalidInputError(f"generation must be a value of KVCacheStore.generation (now {self.generation}) "
                                    f"or None, got {generation!r}")
        return generation == self.generation

    def retain(self, keys: Sequence[BlockKey], seconds: float) -> RetainResult:
        self._check_open()
        keys = check_keys(keys)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_RETAIN_S:
            raise InvalidInputError(f"retain seconds must be a number in (0, {MAX_RETAIN_S}], got {seconds!r}")
        with self._lock:
            self._check_open()
            return self.retention.retain(keys, float(seconds))

    def prioritize(self, keys: Sequence[BlockKey], priority: str) -> PriorityResult:
        self._check_open()
        keys = check_keys(keys)
        level = parse_priority(priority)
        with self._lock:
            self._check_open()
            return prioritize(self._stack, self.retention, keys, level)

    def verify(self, keys: Sequence[BlockKey], computed: Sequence[torch.Tensor], *,
               tolerance: float = 0.0) -> VerifyResult:
        self._check_open()
        tolerance = check_tolerance(tolerance)
        keys = check_keys(keys)
        check_block_tensors(self._config, computed, len(keys))
        bound, unbounded = store_bound(self._config, tolerance)
        with self._lock:
            self._check_open()
            result = self._stack.verify(list(keys), computed, unbounded, self._config.namespace, bound)
            bad = [keys[i].block_hash for idx in result.mismatches.values() for i in idx]
            if bad:
                self._quarantines += 1
            if bad and self.retention.release(bad):  # a retained block is quarantined all the same
                self._stack.discard(bad)
            c = self.counters
            c.num_verified_blocks += result.num_checked
            for kind, idx in result.mismatches.items():
                c.verify_mismatches[kind] = c.verify_mismatches.get(kind, 0) + len(idx)
            for kind, check in result.tiers.items():  # the largest error seen, and bound used, per tier
                c.verify_max_error[kind] = max(c.verify_max_error.get(kind, 0.0), check.max_error)
                c.verify_bound[kind] = max(c.verify_bound.get(kind, 0.0), check.bound)
            return result

    def prefetch(self, keys: Sequence[BlockKey], *, max_blocks: int | None = None) -> Future[PrefetchResult]:
        self._check_open()
        cap = check_max_blocks(max_blocks)
        keys = check_keys(keys)
        built = list(keys[:cap])  # here: the caller may change its tokens once this returns
        capped = len(keys) - len(built)
        with self._lock:
            self.counters.num_prefetch_calls += 1
        if not self._prefetches.acquire(blocking=False):  # too many waiting: a hint, never a pile of work
            with self._lock:
                self.counters.num_prefetch_dropped += 1
            self._warn(f"prefetch dropped: {self._prefetch_limit} prefetches already wait or run "
                       "(counted in num_prefetch_dropped)")
            dropped: Future[PrefetchResult] = Future()
            dropped.set_result(PrefetchResult(PrefetchStatus.DROPPED, num_capped=capped))
            return dropped
        try:
            future = self._work.submit(self._prefetch, built, capped)
        except BaseException:
            self._prefetches.release()
            raise
        future.add_done_callback(lambda _: self._prefetches.release())  # run, or cancelled by the caller while queued
        return future

    def _prefetch(self, keys: list[BlockKey], capped: int) -> PrefetchResult:
        try:
            result = self._prefetch_now(keys, capped)
        except StoreClosedError:  # close() began: a queued or running prefetch moves nothing
            result = PrefetchResult(PrefetchStatus.CLOSED, num_capped=capped)
        except Exception as exc:  # a fault is a counted miss, never a raised future
            with self._lock:
                self.counters.num_prefetch_failed += 1
            self._warn(f"prefetch failed ({type(exc).__name__}: {exc}); counted in num_prefetch_failed")
            result = PrefetchResult(PrefetchStatus.FAULT, num_capped=capped)
        return result

    def _prefetch_now(self, keys: list[BlockKey], capped: int) -> PrefetchResult:
        hashes = key_hashes(keys)
        work, stack = self._work, self._stack
        with work.outside():
            with self._lock:
                if work.closing:
                    return PrefetchResult(PrefetchStatus.CLOSED, num_capped=capped)
                # What the reads below see; a clear() or a verify removal later voids them.
                generation, quarantines = self.generation, self._quarantines
                # Room other running prefetches planned is theirs: together their buffers
                # never exceed the memory tier's room, nor do their inserts evict each other.
                # Blocks another is reading are its own: read once, counted as in flight.
                view = (generation, quarantines)
                plan = stack.plan_prefetch(hashes, reserved=len(self.retention) + self._prefetch_planned,
                                           in_flight=self._prefetch_reading.get(view, frozenset()))
                reading = [hashes[p] for p in plan.positions] if plan is not None else []
                self._prefetch_planned += len(reading)
                in_flight = self._prefetch_reading.setdefault(view, Counter())
                in_flight.update(reading)
            try:
                return self._prefetch_planned_run(keys, hashes, capped, plan, generation, quarantines)
            finally:
                with self._lock:
                    self._prefetch_planned -= len(reading)
                    in_flight.subtract(reading)
                    in_flight += Counter()  # drops the hashes no prefetch reads now
                    if not in_flight and self._prefetch_reading.get(view) is in_flight:
                        del self._prefetch_reading[view]  # no prefetch of that view runs

    def _prefetch_planned_run(self, keys: list[BlockKey], hashes: list[BlockHash], capped: int,
                              plan: Prefetch | None, generation: int, quarantines: int) -> PrefetchResult:
        """Read `plan`'s blocks into a buffer and insert them into memory unless a clear, a
        verify removal or close() came between (see `_prefetch_now`)."""
        work, stack = self._work, self._stack
        closed = PrefetchResult(PrefetchStatus.CLOSED, num_capped=capped)
        status, got = PrefetchStatus.DONE, 0
        if plan is not None and plan.positions:
            buffer = BlockBatch(torch.empty((len(plan.positions), *self._config.block_shape),
                                            dtype=self._config.layout.dtype))
            got, counts = stack.read_prefetch(keys, plan, buffer, lambda: work.closing)
            with self._lock:
                if work.closing:
                    return closed
                if generation != self.generation:
                    status, got = PrefetchStatus.CLEARED, 0
                elif quarantines != self._quarantines:  # the read may hold a block verify removed
                    status, got = PrefetchStatus.QUARANTINED, 0
                elif got and not stack.insert_prefetched(keys, plan, buffer, got, counts):
                    status, got = PrefetchStatus.FULL, 0
        with self._lock:
            if work.closing:
                return closed
            planned = len(plan.positions) if plan is not None else 0
            failed = planned - got if status is PrefetchStatus.DONE else 0
            c = self.counters
            c.num_prefetch_promoted += got
            c.num_prefetch_failed += failed
            return PrefetchResult(status, plan.num_held if plan else 0, plan.num_already if plan else 0, got,
                                  failed, plan.num_unfit if plan else 0, capped, stack.leading_in_memory(hashes),
                                  plan.num_in_flight if plan else 0)

    def take_events(self) -> EventBatch:
        with self._lock:
            self._check_open()
            self._events.start(self._stack.changes)
            self._stack.changes.publish()
        return self._events.take()

    def clear(self, *, all_namespaces: bool = False) -> ClearResult:
        """Delete the store's blocks from every tier (see `KVCacheStore.clear`) and begin a new
        generation; the event log records each tier cleared. Call with the lock held."""
        self.generation += 1
        self.retention.forget()  # the tier's pins go with its blocks
        return self._stack.clear(all_namespaces=all_namespaces)  # each tier's CLEARED goes to the event log
