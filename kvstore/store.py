"""`KVCacheStore`: prefix-matching store/retrieve of KV tensors over a stack of tiers.

A facade: each call validates its input, hashes tokens into block keys (`keying.py`), takes
the store's lock, delegates to the tier stack (`tier_stack.py`, the one place that moves
bytes) and counts. Background work and the order in which `close()` ends it are
`lifecycle.py`'s; KV events are wired by `events_setup.py`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from kvevents import EventPublisher
from kvstore.block_api import BlockAPI
from kvstore.buffers import BufferPool
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, InvalidInputError, LayoutMismatchError, StoreClosedError
from kvstore.hashing import BlockChain, BlockHash, ExtraKeys, namespace_seed
from kvstore.keying import Keyer
from kvstore.lifecycle import Lifecycle
from kvstore.load_policy import LoadPolicy
from kvstore.results import ClearResult, CloseResult, LoadResult, RetrieveResult, StoreCounters, StoreStats
from kvstore.tier_factory import build_tiers, engine_pool
from kvstore.tier_stack import TierStack
from kvstore.timing import timed
from kvstore.validate import check_device, check_disjoint, check_kv, check_writable
from tiers.base import BlockKey, ScrubResult, Tier, TierKind
from tiers.blockbatch import BlockBatch, block_rows
from tiers.gpu_pool import BlockPool

__all__ = ["CloseResult", "KVCacheStore", "LoadResult", "RetrieveResult", "StoreStats"]

logger = logging.getLogger(__name__)


class KVCacheStore:
    """A prefix-matching KV cache over a stack of tiers (block pool, CPU, disk, remote),
    fastest first.

    `store` writes new full blocks into the top tier; tiers demote their least recently used
    blocks downwards. `retrieve` walks the chained block hashes through the tiers in order,
    stops at the first miss, and promotes lower-tier hits into the top tier. All calls are
    thread-safe (one lock per store); several processes may share one `disk_path`.
    """

    def __init__(self, config: StoreConfig) -> None:
        if not isinstance(config, StoreConfig):
            raise ConfigError(f"KVCacheStore needs a StoreConfig, got {type(config).__name__}")
        self.config = config
        self._seed = namespace_seed(config.identity(), config.hash_algo)
        self._keyer = Keyer(config, self._seed)
        tiers = build_tiers(config, self._seed)
        self.pool: BlockPool | None = engine_pool(tiers)  # the paged KV an engine attends over
        self._stack = TierStack(tiers, write_through=config.write_through)
        self.load_policy = LoadPolicy(config.load_policy, config.block_size, config.block_bytes,
                                      free=frozenset(t.kind for t in tiers if t.traits.engine_memory))
        self._stack.on_load = lambda kind, blocks, seconds: self.load_policy.observe_load(
            kind, blocks * config.block_bytes, seconds)
        self._lock = threading.RLock()
        self._closed = False
        self._generation = 0  # clear() calls so far (see `generation`)
        self._counters = StoreCounters()
        self._work = Lifecycle(config.io_threads)
        self._buffers = BufferPool(config.result_buffer_bytes)  # recycled results of retrieve()
        # Called with ("store" | "retrieve" | "load", seconds) after each such call when set
        # (kvstore.metrics.register_metrics sets it).
        self.observe_latency: Callable[[str, float], None] | None = None
        self.events: EventPublisher | None = None
        if config.events_endpoint is not None:
            from kvstore.events_setup import open_publisher

            try:
                self.events = open_publisher(config, self._seed, self._stack)
            except BaseException:
                self._stack.close()
                raise

    # -- views -------------------------------------------------------------------------------
    def __enter__(self) -> KVCacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # never raises for a full disk

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._stack.tiers

    @property
    def stack(self) -> TierStack:
        """The tier stack (hold `lock` while using it); engines use `kvstore.block_api`."""
        return self._stack

    @property
    def seed(self) -> BlockHash:
        """Root of this store's hash chains (a digest of `config.identity()`)."""
        return self._seed

    @property
    def lock(self) -> threading.RLock:
        """The lock every store call holds; hold it to mutate tiers from outside."""
        return self._lock

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        """How many times `clear()` has run. Read it when KV is produced and pass it as
        `generation=` to a later `store` / `store_blocks`: KV produced before a `clear()` is
        then never cached after it."""
        return self._generation

    @property
    def prefetched_blocks(self) -> dict[TierKind, int]:
        """Blocks `prefetch` brought into memory, by the tier they came from."""
        return self._stack.num_prefetched

    def check_open(self) -> None:
        """Raise `StoreClosedError` if the store was closed."""
        if self._closed:
            raise StoreClosedError("KVCacheStore is closed")

    def _current(self, generation: int | None) -> bool:
        """Whether KV produced at `generation` may be stored now (call with the lock held)."""
        if generation is None:
            return True
        if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation <= self._generation:
            raise InvalidInputError(f"generation must be a value of KVCacheStore.generation (now {self._generation}) "
                                    f"or None, got {generation!r}")
        return generation == self._generation

    # -- hashing -----------------------------------------------------------------------------
    def block_hashes(self, tokens: object, extra_keys: ExtraKeys | None = None,
                     chain: BlockChain | None = None) -> list[BlockHash]:
        """The chained keys of `tokens`' full blocks here (through `chain`: only new blocks)."""
        return self._keyer.hashes(tokens, extra_keys, chain)[1]

    def chain(self, extra_keys: ExtraKeys | None = None) -> BlockChain:
        """A `BlockChain` in this store's namespace: pass it as `chain=` to `store_blocks` /
        `retrieve_into` calls on one growing sequence, so each block is hashed once."""
        return self._keyer.chain(extra_keys)

    def block_keys(self, arr: np.ndarray, hashes: Sequence[BlockHash], extra_keys: ExtraKeys | None = None, *,
                   first_block: int = 0, parent: BlockHash | None = None) -> list[BlockKey]:
        """The `BlockKey`s the tiers take for `hashes` (see `Keyer.keys`)."""
        return self._keyer.keys(arr, hashes, extra_keys, first_block=first_block, parent=parent)

    # -- the API -----------------------------------------------------------------------------
    @timed("store")
    def store(self, tokens: object, kv: object, *, extra_keys: ExtraKeys | None = None,
              generation: int | None = None) -> int:
        """Store every full block of `tokens` not yet cached; return the leading tokens now cached.

        `kv` is `[num_layers, 2, len(tokens), num_kv_heads, head_dim]` of the layout's dtype on
        any device. Invalid input raises an `InvalidInputError` subclass and stores nothing;
        `DiskFullError` means the tiers could not make room (reads keep working). With
        `generation` (see the property) older than the store's, stores nothing and returns 0.
        """
        self.check_open()
        arr, hashes = self._keyer.hashes(tokens, extra_keys)
        kv = check_kv(self.config, kv, len(arr))
        b = self.config.block_size
        keys = self._keyer.keys(arr, hashes, extra_keys)
        with self._lock:
            self.check_open()
            current = self._current(generation)  # raises for a bad value before anything counts
            self._counters.num_store_calls += 1
            if not current:
                return 0
            self._counters.num_blocks_stored += self._stack.put(keys, BlockBatch(block_rows(kv, b)))
            if len(keys) <= self._stack.top.capacity_blocks:
                return len(keys) * b  # the top tier took every block (no second lookup)
            return len(self._stack.locate(hashes)) * b  # more than the top tier holds: some may be gone

    @timed("retrieve")
    def retrieve(self, tokens: object, *, extra_keys: ExtraKeys | None = None,
                 device: torch.device | str | None = None, out: torch.Tensor | None = None) -> RetrieveResult:
        """Return the KV of the longest cached prefix of `tokens` (on `device`, default CPU).

        Blocks come from the fastest tier holding them; lower-tier hits are promoted to the
        top tier. A block that fails validation ends the prefix there and is deleted. With
        `out` (`[num_layers, 2, >= len(tokens), num_kv_heads, head_dim]` of the layout's dtype),
        the KV is written there and `kv` is a view of it (no allocation, no page faults);
        `out` beyond the returned prefix is left untouched.
        """
        self.check_open()
        device = check_device(device)
        if out is not None:
            check_kv(self.config, out, out.shape[2] if isinstance(out, torch.Tensor) and out.dim() == 5 else -1)
            check_writable(out, "out")
            check_disjoint([out], "out's elements")
        arr, hashes = self._keyer.hashes(tokens, extra_keys)
        cfg, b = self.config, self.config.block_size
        if out is not None and out.shape[2] < len(arr) // b * b:
            raise LayoutMismatchError(f"out holds {out.shape[2]} tokens, fewer than the {len(arr)} given")
        keys = self._keyer.keys(arr, hashes, extra_keys)
        with self._lock:
            self.check_open()
            self._counters.num_retrieve_calls += 1
            self._counters.num_tokens_requested += len(arr)
            given = out is not None
            # With the caller's buffer, the slowest tier is read without a lookup first (one
            # round trip to a remote server, one transaction on disk); else the hit's length
            # sizes the allocation.
            plan = self._stack.plan_load(hashes) if given else self._stack.locate(hashes)
            if not plan:
                return RetrieveResult(0, None, {})
            if out is None:
                shape = cfg.layout.block_shape(len(plan) * b)
                out = (self._buffers.tensor(shape, cfg.layout.dtype) if device.type == "cpu"
                       else torch.empty(shape, dtype=cfg.layout.dtype, device=device))
            dsts = BlockBatch(block_rows(out[:, :, : len(plan) * b], b))
            num_ok, counts = self._stack.load(keys, dsts, plan)
            self._stack.promote(keys, dsts, plan, num_ok)
            self._counters.num_tokens_hit += num_ok * b
        if num_ok == 0:
            return RetrieveResult(0, None, {})
        if given or num_ok == len(plan):
            return RetrieveResult(num_ok * b, out[:, :, : num_ok * b], counts)
        return RetrieveResult(num_ok * b, out[:, :, : num_ok * b].clone(), counts)

    def lookup(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """The `num_tokens` that `retrieve` would return now; moves no KV data, changes nothing.

        A record found damaged by a later `retrieve` can make that call return less.
        """
        return len(self.locate(tokens, extra_keys=extra_keys)) * self.config.block_size

    def locate(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> list[TierKind]:
        """The tier that would serve each block of the longest cached prefix (what `lookup`
        measures, with where from); changes nothing."""
        self.check_open()
        _, hashes = self._keyer.hashes(tokens, extra_keys)
        with self._lock:
            self.check_open()
            self._counters.num_lookup_calls += 1
            tiers = self._stack.tiers
            return [tiers[i].kind for i in self._stack.locate(hashes)]

    # -- the block-level API, for engines that page KV in blocks of their own ----------------
    @functools.cached_property
    def blocks(self) -> BlockAPI:
        """Whole-block saves and loads, and the block pool's calls (`kvstore.block_api`)."""
        return BlockAPI(self)

    def store_blocks(self, tokens: object, srcs: Sequence[torch.Tensor], *, first_block: int = 0,
                     extra_keys: ExtraKeys | None = None, chain: BlockChain | None = None,
                     generation: int | None = None) -> int:
        """`blocks.save` (see there)."""
        return self.blocks.save(tokens, srcs, first_block=first_block, extra_keys=extra_keys, chain=chain,
                                generation=generation)

    def retrieve_into(self, tokens: object, dsts: Sequence[torch.Tensor], *, first_block: int = 0,
                      extra_keys: ExtraKeys | None = None, chain: BlockChain | None = None) -> LoadResult:
        """`blocks.load` (see there)."""
        return self.blocks.load(tokens, dsts, first_block=first_block, extra_keys=extra_keys, chain=chain)

    # -- background work: prefetch and the asyncio API ---------------------------------------
    def prefetch(self, tokens: object, *, extra_keys: ExtraKeys | None = None,
                 chain: BlockChain | None = None) -> Future[int]:
        """Bring the longest cached prefix of `tokens` from tiers outside memory (disk, remote)
        into the slowest memory tier (the CPU tier; the pool without one), in the background.
        The future resolves to the leading tokens then held in memory tiers (`chain`: as in `block_hashes`).

        Bad input raises here, at once, as does `StoreClosedError` once `close()` has begun.
        The slow reads run without the store's lock (other calls proceed meanwhile); only the
        final insert takes it, and inserts nothing if `clear()` ran since the reads began. A
        prefetch that `close()` finds queued or running resolves to 0 (never cancelled).
        """
        self.check_open()
        arr, hashes = self._keyer.hashes(tokens, extra_keys, chain)
        keys = self._keyer.keys(arr, hashes, extra_keys)
        return self._work.submit(self._prefetch, keys)

    def _prefetch(self, keys: list[BlockKey]) -> int:
        hashes = [k.block_hash for k in keys]
        try:
            with self._work.outside():
                with self._lock:
                    if self._work.closing:
                        return 0
                    generation = self._generation  # what the reads below see; a clear() later voids them
                    plan = self._stack.plan_prefetch(hashes)
                if plan is not None:
                    buffer = BlockBatch(torch.empty((len(plan.positions), *self.config.block_shape),
                                                    dtype=self.config.layout.dtype))
                    got, counts = self._stack.read_prefetch(keys, plan, buffer, lambda: self._work.closing)
                    with self._lock:
                        if got and generation == self._generation and not self._work.closing:
                            self._stack.insert_prefetched(keys, plan, buffer, got, counts)
                with self._lock:
                    return 0 if self._work.closing else self._stack.leading_in_memory(hashes) * self.config.block_size
        except StoreClosedError:  # close() began: a queued or running prefetch resolves to 0
            return 0

    async def astore(self, tokens: object, kv: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """`store` on the store's I/O threads (`StoreConfig.io_threads` at a time), for event
        loops: the loop never blocks on a copy or a disk write. Stores nothing (returns 0) if
        `clear()` runs between this call and its turn on a thread.

        The asyncio calls raise `StoreClosedError` when `close()` has begun before they ran
        (never `asyncio.CancelledError`); one already running completes."""
        return await self._work.run_async(self.store, tokens, kv, extra_keys=extra_keys, generation=self._generation)

    async def aretrieve(self, tokens: object, *, extra_keys: ExtraKeys | None = None,
                        device: torch.device | str | None = None, out: torch.Tensor | None = None) -> RetrieveResult:
        """`retrieve` on the store's I/O threads (see `astore`)."""
        return await self._work.run_async(self.retrieve, tokens, extra_keys=extra_keys, device=device, out=out)

    async def alookup(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """`lookup` on the store's I/O threads (see `astore`)."""
        return await self._work.run_async(self.lookup, tokens, extra_keys=extra_keys)

    # -- housekeeping ------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Counters and per-tier snapshots; changes nothing."""
        with self._lock:
            self.check_open()
            c = self._counters
            return StoreStats(c.num_store_calls, c.num_retrieve_calls, c.num_lookup_calls, c.num_blocks_stored,
                              c.num_tokens_requested, c.num_tokens_hit, self._stack.num_promotion_failures,
                              tuple(t.stats() for t in self._stack.tiers))

    def check_integrity(self) -> None:
        """Raise `RuntimeError` if any tier's invariants are broken (a bug)."""
        with self._lock:
            self.check_open()
            self._stack.check_integrity()

    def flush(self) -> bool:
        """Return once every block stored so far is visible to other hosts (the remote tier's
        background writes sent, or dropped for a fault and counted). False on a timeout."""
        self.check_open()
        with self._work.outside():  # close() waits for it to end before closing the tiers
            return self._stack.flush()

    def clear(self, *, all_namespaces: bool = False) -> ClearResult:
        """Delete this store's blocks from every tier; the result says whether the remote tier
        finished (docs/remote.md). A shared disk or server loses only this namespace's blocks,
        unless `all_namespaces` (all kvstrata wrote in `disk_path` and on the server, whoever).
        Work begun before the clear never brings its bytes back after it: a running `prefetch`
        inserts nothing, a queued `astore` stores nothing, nor does a `store` / `store_blocks`
        given an older `generation`."""
        with self._lock:
            self.check_open()
            self._generation += 1
            return self._stack.clear(all_namespaces=all_namespaces)

    def scrub(self) -> ScrubResult | None:
        """Validate every record of the tiers that keep checks (the disk); delete damaged ones
        (of any namespace: they are garbage to every reader). Sound records of other namespaces
        are left alone. None without such a tier."""
        with self._lock:
            self.check_open()
            return self._stack.scrub()

    def close(self) -> CloseResult:
        """Persist what fits (with `persist_on_close`) and release every tier. Idempotent and
        safe from several threads at once (a second call waits for the first, then returns
        `CloseResult(0, 0)`); other calls then raise `StoreClosedError`.

        Background work ends first: a prefetch that is queued or running resolves to 0, a
        queued asyncio call raises `StoreClosedError`, running ones and a running `flush()`
        complete; when any close() returns, the I/O threads are gone. Never raises for a full
        disk: blocks a full lower tier refuses are counted in the result and logged, most
        recently used blocks having gone first.
        """
        with self._work.close_lock:
            self._work.begin_close()
            try:
                with self._lock:
                    if self._closed:
                        return CloseResult(0, 0)
                    self._closed = True
                    spilled = refused = 0
                    try:
                        if self.config.persist_on_close:
                            spilled, refused = self._stack.spill()
                        if refused:
                            logger.warning("kvstrata: close() persisted %d blocks; a full disk refused %d",
                                           spilled, refused)
                    finally:
                        self._stack.close()
                    return CloseResult(spilled, refused)
            finally:
                if self.events is not None:  # idempotent; outside the lock: its thread may wait for it
                    self.events.close()
