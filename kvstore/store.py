"""`KVCacheStore`: prefix-matching store/retrieve of KV tensors over a stack of tiers.

A facade: the token API (`store`, `retrieve`, `lookup`, `prefetch`) validates its input,
hashes the tokens into block keys (`keying.py`) and calls the engine API (`blocks`, a
`block_store.TierBlockStore` over the tier stack: the one door that moves blocks), which
engines with paged KV of their own call directly; a runner attending over the block pool
takes pool blocks through `allocator` (`pool_api.py`). Background work and the order in
which `close()` ends it are `lifecycle.py`'s; KV events are wired by `events_setup.py`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvevents import EventPublisher
from kvstore.block_store import TierBlockStore
from kvstore.buffers import BufferPool
from kvstore.change_feed import ChangeFeed
from kvstore.config import StoreConfig
from kvstore.engine_api import BlockStore, LoadResult
from kvstore.errors import ConfigError, LayoutMismatchError, StoreClosedError
from kvstore.hashing import BlockChain, BlockHash, ExtraKeys, namespace_seed
from kvstore.keying import Keyer
from kvstore.lifecycle import Lifecycle
from kvstore.load_policy import LoadPolicy
from kvstore.pool_api import PoolAllocator
from kvstore.prefetch import PrefetchResult, check_max_blocks
from kvstore.priority import PriorityResult, parse_priority
from kvstore.results import ClearResult, CloseResult, RetrieveResult, StoreCounters, StoreStats
from kvstore.retention import RetainResult
from kvstore.tier_factory import build_tiers, engine_pool
from kvstore.tier_stack import TierStack
from kvstore.timing import timed
from kvstore.validate import check_device, check_disjoint, check_kv, check_writable
from kvstore.verify import VerifyResult
from tiers.base import ScrubResult, Tier
from tiers.keys import BlockKey, TierKind
from tiers.pool.gpu_pool import BlockPool
from tiers.shared.blockbatch import BlockBatch, block_rows

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
        self._counters = StoreCounters()
        self._work = Lifecycle(config.io_threads)
        self._blocks = TierBlockStore(config, self._stack, self._lock, self._counters, self._work, self.check_open)
        self._buffers = BufferPool(config.result_buffer_bytes)  # recycled results of retrieve()
        self._observe_latency: Callable[[str, float], None] | None = None
        self.events: EventPublisher | None = None
        if config.events_endpoint is not None:
            from kvstore.events_setup import open_publisher

            try:
                self.events = open_publisher(config, self._seed, self._stack, self._lock)
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
    def changes(self) -> ChangeFeed:
        """Where the tiers' changes go, in order (`kvstore.change_feed`): `add_sink` follows
        them (the KV-event publisher and `blocks.take_events` are sinks)."""
        return self._stack.changes

    @property
    def blocks(self) -> BlockStore:
        """The engine API (`kvstore.engine_api`): block-keyed lookup, load, save, prefetch and
        events, for engines that page KV in blocks of their own; keys from `keys` or
        `engine_keys`."""
        return self._blocks

    @functools.cached_property
    def allocator(self) -> PoolAllocator:
        """The block pool's allocation calls (`kvstore.pool_api`), for a runner attending over
        the pool; `ConfigError` on a store without one."""
        if self.pool is None:
            raise ConfigError("this call needs a store with a block pool (StoreConfig.pool_blocks > 0)")
        return PoolAllocator(self.pool, self._stack, self._lock, self.check_open)

    @property
    def observe_latency(self) -> Callable[[str, float], None] | None:
        """Called with ("store" | "retrieve" | "load", seconds) after each such call when set
        (`kvstore.metrics.register_metrics` sets it); a call's inner calls are not reported."""
        return self._observe_latency

    @observe_latency.setter
    def observe_latency(self, hook: Callable[[str, float], None] | None) -> None:
        self._observe_latency = self._blocks.observe_latency = hook

    @property
    def seed(self) -> BlockHash:
        """Root of this store's hash chains (a digest of `config.identity()`)."""
        return self._seed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        """How many times `clear()` has run. Read it when KV is produced and pass it as
        `generation=` to a later `store` / `blocks.save`: KV produced before a `clear()` is
        then never cached after it."""
        return self._blocks.generation

    @property
    def prefetched_blocks(self) -> dict[TierKind, int]:
        """Blocks `prefetch` brought into memory, by the tier they came from."""
        return self._stack.num_prefetched

    def check_open(self) -> None:
        """Raise `StoreClosedError` if the store was closed."""
        if self._closed:
            raise StoreClosedError("KVCacheStore is closed")

    # -- keys --------------------------------------------------------------------------------
    def block_hashes(self, tokens: object, extra_keys: ExtraKeys | None = None,
                     chain: BlockChain | None = None) -> list[BlockHash]:
        """The chained keys of `tokens`' full blocks here (through `chain`: only new blocks)."""
        return self._keyer.hashes(tokens, extra_keys, chain)[1]

    def chain(self, extra_keys: ExtraKeys | None = None) -> BlockChain:
        """A `BlockChain` in this store's namespace: pass it as `chain=` to `keys` / `prefetch`
        calls on one growing sequence, so each block is hashed once."""
        return self._keyer.chain(extra_keys)

    def keys(self, tokens: object, *, extra_keys: ExtraKeys | None = None, chain: BlockChain | None = None,
             first_block: int = 0, num_blocks: int | None = None) -> Sequence[BlockKey]:
        """The engine API's keys of full blocks `first_block .. first_block + num_blocks - 1`
        of `tokens` (default: all from `first_block` on), hashed through `chain` when given;
        blocks before `first_block` are hashed (they chain into the keys), never read.
        Invalid tokens, extra keys or counts raise an `InvalidInputError` subclass. The keys
        are built from `tokens` when first used: do not change a token array meanwhile."""
        return self._keyer.token_keys(tokens, extra_keys, chain=chain, first_block=first_block,
                                      num_blocks=num_blocks)

    def engine_keys(self, ids: Sequence[object], tokens: Sequence[object | None] | None = None) -> list[BlockKey]:
        """The engine API's keys of blocks an engine names by its own `ids` (bytes or text:
        SGLang's page hashes, say), in this store's namespace; `tokens[i]`, one block of
        token ids or None, is verified on every hit (other tokens: a miss). See
        `kvstore.engine_api`."""
        return self._keyer.engine_keys(ids, tokens)

    # -- the token API: tokens hashed into keys, then the engine API --------------------------
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
        keys = self._keyer.lazy_keys(arr, hashes, extra_keys, 0, len(hashes))
        return self._blocks.save(keys, BlockBatch(block_rows(kv, b)), generation=generation).num_held * b

    @timed("retrieve")
    def retrieve(self, tokens: object, *, extra_keys: ExtraKeys | None = None,
                 device: torch.device | str | None = None, out: torch.Tensor | None = None) -> RetrieveResult:
        """Return the KV of the longest cached prefix of `tokens` (on `device`, default CPU).

        Blocks come from the fastest tier holding them; lower-tier hits are promoted to the
        top tier. A block that fails validation ends the prefix there and is deleted. With
        `out` (`[num_layers, 2, >= len(tokens), num_kv_heads, head_dim]` of the layout's dtype),
        the KV is written there and `kv` is a view of it (no allocation, no page faults);
        `out` beyond the returned prefix holds undefined bytes (a shared tier receives a block
        in place before checking it).
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
        keys = self._keyer.lazy_keys(arr, hashes, extra_keys, 0, len(hashes))
        made: list[torch.Tensor] = []

        def allocate(num_blocks: int) -> BlockBatch:  # sized by the hit
            shape = cfg.layout.block_shape(num_blocks * b)
            made.append(self._buffers.tensor(shape, cfg.layout.dtype) if device.type == "cpu"
                        else torch.empty(shape, dtype=cfg.layout.dtype, device=device))
            return BlockBatch(block_rows(made[0], b))

        with self._lock:
            self.check_open()
            self._counters.num_tokens_requested += len(arr) - len(keys) * b  # a partial block (load counts the rest)
            dsts = allocate if out is None else BlockBatch(block_rows(out[:, :, : len(keys) * b], b))
            num_ok, counts = self._blocks.load(keys, dsts)
        if num_ok == 0:
            return RetrieveResult(0, None, {})
        if out is not None:
            return RetrieveResult(num_ok * b, out[:, :, : num_ok * b], counts)
        kv = made[0]
        return RetrieveResult(num_ok * b, kv if kv.shape[2] == num_ok * b else kv[:, :, : num_ok * b].clone(), counts)

    def lookup(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """The `num_tokens` that `retrieve` would return now; moves no KV data, changes nothing.

        A record found damaged by a later `retrieve` can make that call return less.
        """
        return len(self.locate(tokens, extra_keys=extra_keys)) * self.config.block_size

    def retain(self, tokens: object, seconds: float, *, extra_keys: ExtraKeys | None = None) -> RetainResult:
        """Keep the cached full blocks of `tokens` through eviction pressure for `seconds`
        (`blocks.retain`: within the tenant's budget; the rest reported clipped)."""
        self.check_open()
        arr, hashes = self._keyer.hashes(tokens, extra_keys)
        return self._blocks.retain(list(self._keyer.lazy_keys(arr, hashes, extra_keys, 0, len(hashes))), seconds)

    def prioritize(self, tokens: object, priority: str, *, extra_keys: ExtraKeys | None = None) -> PriorityResult:
        """Give the cached full blocks of `tokens` an eviction priority, "low", "normal" or
        "high" (`blocks.prioritize`)."""
        self.check_open()
        parse_priority(priority)  # before hashing: a bad value changes nothing and names itself
        arr, hashes = self._keyer.hashes(tokens, extra_keys)
        return self._blocks.prioritize(list(self._keyer.lazy_keys(arr, hashes, extra_keys, 0, len(hashes))), priority)

    def verify(self, tokens: object, kv: object, *, extra_keys: ExtraKeys | None = None,
               tolerance: float = 0.0) -> VerifyResult:
        """Compare `kv` (as `store` takes it), just computed for `tokens`, with what every tier
        holds for its full blocks; remove each block that differs beyond the bound anywhere
        from every tier (`blocks.verify`, `kvstore/verify.py`). Stores nothing."""
        self.check_open()
        arr, hashes = self._keyer.hashes(tokens, extra_keys)
        kv = check_kv(self.config, kv, len(arr))
        keys = self._keyer.lazy_keys(arr, hashes, extra_keys, 0, len(hashes))
        return self._blocks.verify(list(keys), BlockBatch(block_rows(kv, self.config.block_size)), tolerance=tolerance)

    def locate(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> list[TierKind]:
        """The tier that would serve each block of the longest cached prefix (what `lookup`
        measures, with where from); changes nothing."""
        self.check_open()
        return self._blocks.lookup(self._keyer.token_keys(tokens, extra_keys)).tiers

    # -- background work: prefetch and the asyncio API ---------------------------------------
    def prefetch(self, tokens: object, *, extra_keys: ExtraKeys | None = None,
                 chain: BlockChain | None = None, max_blocks: int | None = None) -> Future[PrefetchResult]:
        """Bring the longest cached prefix of `tokens` (its first `max_blocks` blocks at most;
        default `MAX_PREFETCH_BLOCKS`) from tiers outside memory (disk, remote) into the
        slowest memory tier, in the background, never evicting retained blocks; the future
        resolves to a `PrefetchResult` (in blocks; never an exception).

        Bad input raises here, at once, as does `StoreClosedError` once `close()` has begun.
        Beyond the bound on waiting prefetches one is dropped and counted (its future already
        resolved). The slow reads run without the store's lock; the insert takes it, and
        inserts nothing if `clear()` ran since the reads began. One `close()` finds queued or
        running resolves as `CLOSED` (never cancelled). See `kvstore/prefetch.py`.
        """
        self.check_open()
        cap = check_max_blocks(max_blocks)
        keys = self._keyer.token_keys(tokens, extra_keys, chain=chain)
        return self._blocks.prefetch(keys, max_blocks=cap)

    async def astore(self, tokens: object, kv: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """`store` on the store's I/O threads (`StoreConfig.io_threads` at a time), for event
        loops: the loop never blocks on a copy or a disk write. Stores nothing (returns 0) if
        `clear()` runs between this call and its turn on a thread.

        The asyncio calls raise `StoreClosedError` when `close()` has begun before they ran
        (never `asyncio.CancelledError`); one already running completes."""
        return await self._work.run_async(self.store, tokens, kv, extra_keys=extra_keys,
                                          generation=self._blocks.generation)

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
            return self._counters.snapshot(self._stack.num_promotion_failures,
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
        inserts nothing, a queued `astore` stores nothing, nor does a `store` / `blocks.save`
        given an older `generation`."""
        with self._lock:
            self.check_open()
            return self._blocks.clear(all_namespaces=all_namespaces)

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
