"""`KVCacheStore`: prefix-matching store/retrieve of KV tensors over a stack of tiers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

import numpy as np
import torch
import xxhash

from kvstore.buffers import BufferPool
from kvstore.config import StoreConfig
from kvstore.errors import (
    ConfigError,
    DiskFullError,
    InvalidInputError,
    LayoutMismatchError,
    StoreClosedError,
)
from kvstore.events import EventPublisher, EventSource, new_epoch, publisher_config
from kvstore.hashing import BlockChain, BlockHash, ExtraKeys, as_token_array, chain_hashes, namespace_seed, tenant_of
from kvstore.load_policy import LoadPolicy
from kvstore.tier_factory import build_tiers
from kvstore.tier_stack import TierStack
from kvstore.validate import check_blocks, check_device, check_disjoint, check_kv, check_writable
from tiers.base import BlockKey, Tier, TierKind, TierStats
from tiers.blockbatch import BlockBatch, block_rows
from tiers.gpu_pool import BlockPool
from tiers.lmdb import LMDBTier, ScrubResult
from tiers.remote import RemoteTier

logger = logging.getLogger(__name__)
P = ParamSpec("P")
_UNKNOWN = object()  # block_keys: the extra keys are not known
R = TypeVar("R")


def _timed(op: str) -> Callable[[Callable[Concatenate[KVCacheStore, P], R]], Callable[Concatenate[KVCacheStore, P], R]]:
    """Report the wall time of a store call to `store.observe_latency` when one is set."""

    def wrap(fn: Callable[Concatenate[KVCacheStore, P], R]) -> Callable[Concatenate[KVCacheStore, P], R]:
        def timed(self: KVCacheStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
            hook = self.observe_latency
            if hook is None:
                return fn(self, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                hook(op, time.perf_counter() - t0)

        functools.update_wrapper(timed, fn)  # name and docstring of the wrapped call
        return timed

    return wrap


class RetrieveResult(NamedTuple):
    """What `retrieve` found.

    Attributes:
        num_tokens: length of the longest cached prefix, a multiple of `block_size`.
        kv: `[num_layers, 2, num_tokens, num_kv_heads, head_dim]`, or None when num_tokens == 0.
        blocks_per_tier: how many of the returned blocks each tier served.
    """

    num_tokens: int
    kv: torch.Tensor | None
    blocks_per_tier: dict[TierKind, int]


class CloseResult(NamedTuple):
    """What `close()` persisted: blocks copied down a tier, and blocks a full tier refused."""

    num_spilled: int
    num_refused: int


class LoadResult(NamedTuple):
    """What `retrieve_into` copied: `num_blocks` leading blocks, and how many each tier served."""

    num_blocks: int
    blocks_per_tier: dict[TierKind, int]


@dataclass(frozen=True)
class StoreStats:
    """Counters since the store was opened, and a snapshot of every tier."""

    num_store_calls: int
    num_retrieve_calls: int
    num_lookup_calls: int
    num_blocks_stored: int
    num_tokens_requested: int
    num_tokens_hit: int
    num_promotion_failures: int
    tiers: tuple[TierStats, ...]

    @property
    def hit_ratio(self) -> float:
        return self.num_tokens_hit / self.num_tokens_requested if self.num_tokens_requested else 0.0


class KVCacheStore:
    """A prefix-matching KV cache over the block pool, CPU and LMDB disk tiers, fastest first.

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
        tiers = build_tiers(config, self._seed)
        self.pool: BlockPool | None = tiers[0] if isinstance(tiers[0], BlockPool) else None
        self._stack = TierStack(tiers, write_through=config.write_through)
        self.load_policy = LoadPolicy(config.load_policy, config.block_size, config.block_bytes)
        self._stack.on_load = lambda kind, blocks, seconds: self.load_policy.observe_load(
            kind, blocks * config.block_bytes, seconds)
        self._lock = threading.RLock()
        self.events: EventPublisher | None = None
        if config.events_endpoint is not None:
            try:
                self.events = self._publish(config.events_endpoint)
            except BaseException:
                self._stack.close()
                raise
        self._closed = False
        self._num_store_calls = self._num_retrieve_calls = self._num_lookup_calls = 0
        self._num_blocks_stored = self._num_tokens_requested = self._num_tokens_hit = 0
        # Called with ("store" | "retrieve" | "load", seconds) after each such call when set
        # (kvstore.metrics.register_metrics sets it).
        self.observe_latency: Callable[[str, float], None] | None = None
        self._buffers = BufferPool(config.result_buffer_bytes)  # recycled results of retrieve()
        self._workers: ThreadPoolExecutor | None = None  # prefetch and the asyncio API, started on first use
        # Guards `_workers`, `_closing` and `_num_outside`; close() waits on it for uses of the
        # tiers made without the store's lock (background reads, flush) to end.
        self._workers_lock = threading.Condition(threading.Lock())
        self._closing = False  # close() has begun: no new background work, queued work does nothing
        self._num_outside = 0  # uses of the tiers in progress without the store's lock
        self._close_lock = threading.Lock()  # one close() at a time; a second waits, then returns
        self._generation = 0  # clear() calls so far (see `generation`)
        self.num_prefetched_blocks = 0
        self.prefetched_blocks: dict[TierKind, int] = {}  # by the tier they came from

    def _publish(self, endpoint: str) -> EventPublisher:
        """Start publishing KV events: every tier reports to the publisher from now on, and a
        warm disk is announced with the publisher's first batches. The disk's records are
        read once, here, before the store is handed out: nothing waits on the store's lock."""
        cfg = self.config
        remote = next((t for t in self._stack.tiers if isinstance(t, RemoteTier)), None)
        disk = next((t for t in self._stack.tiers if isinstance(t, LMDBTier)), None)
        warm = list(disk.held_keys()) if disk is not None else []
        if disk is not None and disk.num_unannounceable:
            logger.info("kvstrata: %d disk blocks are not announced in KV events: their records carry no parent or "
                        "token ids (written by an older kvstrata, or without verify_tokens)", disk.num_unannounceable)
        source = EventSource(
            instance_id=cfg.instance_id or f"{socket.gethostname()}:{os.getpid()}",
            model=cfg.model_name or cfg.namespace[:128], seed=bytes(self._seed), block_size=cfg.block_size,
            remote=remote.identity if remote is not None else None,
            namespace_id=xxhash.xxh3_64_hexdigest(bytes(self._seed)), epoch=new_epoch())
        capacity = sum(t.capacity_blocks for t in self._stack.tiers if t.kind is not TierKind.REMOTE)
        config = publisher_config(endpoint, cfg.events_replay_endpoint, cfg.events_topic, cfg.events_curve_cert,
                                  cfg.events_curve_clients, min(capacity + (1 << 16), 1 << 22), cfg.events_connect)
        publisher = EventPublisher(config, source, warm)
        for tier in self._stack.tiers:
            tier.listener = publisher.on_change
            tier.describe = publisher.complete
        return publisher

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> KVCacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # never raises for a full disk

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._stack.tiers

    @property
    def stack(self) -> TierStack:
        """The tier stack: the block-level API (locate / load / put / pin / unpin) for engines
        that page KV in their own blocks. Hold `lock` while using it."""
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
    def generation(self) -> int:
        """How many times `clear()` has run. Read it when KV is produced and pass it as
        `generation=` to a later `store` / `store_blocks`: KV produced before a `clear()` is
        then never cached after it."""
        return self._generation

    def _current(self, generation: int | None) -> bool:
        """Whether KV produced at `generation` may be stored now (call with the lock held)."""
        if generation is None:
            return True
        if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation <= self._generation:
            raise InvalidInputError(f"generation must be a value of KVCacheStore.generation (now {self._generation}) "
                                    f"or None, got {generation!r}")
        return generation == self._generation

    # -- hashing ---------------------------------------------------------------------------
    def block_hashes(self, tokens: object, extra_keys: ExtraKeys | None = None) -> list[BlockHash]:
        """The chained keys of `tokens`' full blocks in this store's namespace."""
        return self._hash(tokens, extra_keys)[1]

    def chain(self, extra_keys: ExtraKeys | None = None) -> BlockChain:
        """A `BlockChain` in this store's namespace: pass it as `chain=` to `store_blocks` /
        `retrieve_into` calls on one growing sequence, so each block is hashed once."""
        if extra_keys is not None and not isinstance(extra_keys, ExtraKeys):
            raise InvalidInputError(f"extra_keys must be ExtraKeys or None, got {type(extra_keys).__name__}")
        return BlockChain(self._seed, self.config.block_size, self.config.hash_algo, extra_keys)

    def _hash(self, tokens: object, extra_keys: ExtraKeys | None,
              chain: BlockChain | None = None) -> tuple[np.ndarray, list[BlockHash]]:
        if extra_keys is not None and not isinstance(extra_keys, ExtraKeys):
            raise InvalidInputError(f"extra_keys must be ExtraKeys or None, got {type(extra_keys).__name__}")
        arr = as_token_array(tokens)
        cfg = self.config
        if chain is None:
            return arr, chain_hashes(arr, cfg.block_size, self._seed, extra_keys, cfg.hash_algo)
        if not isinstance(chain, BlockChain) or (chain.seed, chain.block_size, chain.algo, chain.extra_keys) != (
                self._seed, cfg.block_size, cfg.hash_algo, extra_keys):
            raise InvalidInputError("chain must come from this store's chain() with the same extra_keys")
        return arr, chain.hashes_of(arr)

    def block_keys(self, arr: np.ndarray, hashes: Sequence[BlockHash],
                   extra_keys: ExtraKeys | object | None = _UNKNOWN, *, first_block: int = 0,
                   parent: BlockHash | None = None) -> list[BlockKey]:
        """`BlockKey`s of `hashes`, the keys of blocks `first_block, first_block + 1, ...` of
        a sequence whose tokens from block `first_block` on are `arr` (`parent`: the key of
        block `first_block - 1`, needed when `first_block > 0`), with their token bytes when
        tokens are verified or KV events published. With KV events and the `extra_keys` the
        hashes were made with (None: none), each key also names its parent and its extras, so
        the events can describe the block; without `extra_keys` the blocks are described from
        what was announced of them before, or not announced."""
        if first_block and parent is None:
            raise InvalidInputError("block_keys from block > 0 needs the parent key")
        events = self.events
        known = extra_keys is not _UNKNOWN
        extras = extra_keys if isinstance(extra_keys, ExtraKeys) else None
        tenant = tenant_of(self._seed, extras)
        parents = [parent if first_block else self._seed, *hashes[:-1]]
        if not self.config.verify_tokens and events is None:
            return [BlockKey(h, b"", p, None, tenant) for h, p in zip(hashes, parents)]
        b = self.config.block_size
        buf = arr.tobytes()
        if events is None or not known:
            keys = [BlockKey(h, buf[i * b * 4 : (i + 1) * b * 4], parents[i], None, tenant)
                    for i, h in enumerate(hashes)]
            return keys
        keys = [BlockKey(h, buf[i * b * 4 : (i + 1) * b * 4], parents[i],
                         extras.block_extras(first_block + i, b) if extras is not None else b"", tenant)
                for i, h in enumerate(hashes)]
        events.describe(keys)
        return keys

    # -- the API ---------------------------------------------------------------------------
    @_timed("store")
    def store(self, tokens: object, kv: object, *, extra_keys: ExtraKeys | None = None,
              generation: int | None = None) -> int:
        """Store every full block of `tokens` not yet cached; return the leading tokens now cached.

        `kv` is `[num_layers, 2, len(tokens), num_kv_heads, head_dim]` of the layout's dtype on
        any device. Invalid input raises an `InvalidInputError` subclass and stores nothing;
        `DiskFullError` means the tiers could not make room (reads keep working). With
        `generation` (see the property) older than the store's, stores nothing and returns 0.
        """
        self.check_open()
        arr, hashes = self._hash(tokens, extra_keys)
        kv = check_kv(self.config, kv, len(arr))
        b = self.config.block_size
        keys = self.block_keys(arr, hashes, extra_keys)
        srcs = BlockBatch(block_rows(kv, b))
        with self._lock:
            self.check_open()
            current = self._current(generation)  # raises for a bad value before anything counts
            self._num_store_calls += 1
            if not current:
                return 0
            self._num_blocks_stored += self._stack.put(keys, srcs)
            if len(keys) <= self._stack.top.capacity_blocks:
                return len(keys) * b  # the top tier took every block (no second lookup)
            return len(self._stack.locate(hashes)) * b  # more than the top tier holds: some may be gone

    @_timed("retrieve")
    def retrieve(
        self,
        tokens: object,
        *,
        extra_keys: ExtraKeys | None = None,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
    ) -> RetrieveResult:
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
        arr, hashes = self._hash(tokens, extra_keys)
        if out is not None and out.shape[2] < len(arr) // self.config.block_size * self.config.block_size:
            raise LayoutMismatchError(f"out holds {out.shape[2]} tokens, fewer than the {len(arr)} given")
        keys = self.block_keys(arr, hashes, extra_keys)
        cfg = self.config
        b = cfg.block_size
        with self._lock:
            self.check_open()
            self._num_retrieve_calls += 1
            self._num_tokens_requested += len(arr)
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
            self._num_tokens_hit += num_ok * b
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
        _, hashes = self._hash(tokens, extra_keys)
        with self._lock:
            self.check_open()
            self._num_lookup_calls += 1
            tiers = self._stack.tiers
            return [tiers[i].kind for i in self._stack.locate(hashes)]

    # -- housekeeping ----------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Counters and per-tier snapshots; changes nothing."""
        with self._lock:
            self.check_open()
            return StoreStats(
                num_store_calls=self._num_store_calls,
                num_retrieve_calls=self._num_retrieve_calls,
                num_lookup_calls=self._num_lookup_calls,
                num_blocks_stored=self._num_blocks_stored,
                num_tokens_requested=self._num_tokens_requested,
                num_tokens_hit=self._num_tokens_hit,
                num_promotion_failures=self._stack.num_promotion_failures,
                tiers=tuple(t.stats() for t in self._stack.tiers),
            )

    # -- block-level API, for engines that page KV in their own blocks ---------------------
    @_timed("store")
    def store_blocks(
        self,
        tokens: object,
        srcs: Sequence[torch.Tensor],
        *,
        first_block: int = 0,
        extra_keys: ExtraKeys | None = None,
        chain: BlockChain | None = None,
        generation: int | None = None,
    ) -> int:
        """Store `srcs[i]` as full block `first_block + i` of `tokens`; return how many were new.

        Each src is one block-shaped tensor (`StoreConfig.block_shape`, the layout's dtype, any
        device). `tokens` must cover every given block; the blocks before `first_block` need not
        be cached or given (their hashes chain into the keys). Writes like `store`: into the top
        tier (and the disk tier with `write_through`); blocks already held are only touched.
        Invalid input raises an `InvalidInputError` subclass and stores nothing. With
        `generation` older than the store's (a `clear()` ran since), stores nothing: returns 0.
        """
        self.check_open()
        arr, hashes = self._hash(tokens, extra_keys, chain)
        check_blocks(self.config, srcs, len(arr), first_block)
        keys = self.block_keys(arr, hashes, extra_keys)[first_block : first_block + len(srcs)]
        with self._lock:
            self.check_open()
            current = self._current(generation)  # raises for a bad value before anything counts
            self._num_store_calls += 1
            if not current:
                return 0
            written = self._stack.put(keys, list(srcs))
            self._num_blocks_stored += written
            return written

    @_timed("load")
    def retrieve_into(
        self,
        tokens: object,
        dsts: Sequence[torch.Tensor],
        *,
        first_block: int = 0,
        extra_keys: ExtraKeys | None = None,
        chain: BlockChain | None = None,
    ) -> LoadResult:
        """Copy cached blocks `first_block, first_block + 1, ...` of `tokens` into `dsts`.

        Stops at the first block no tier holds (or that fails validation); `dsts[i]` past that
        are left untouched. Lower-tier hits are promoted as in `retrieve`. The blocks before
        `first_block` are neither read nor required.
        """
        self.check_open()
        arr, hashes = self._hash(tokens, extra_keys, chain)
        check_blocks(self.config, dsts, len(arr), first_block, destination=True)
        keys = self.block_keys(arr, hashes, extra_keys)[first_block : first_block + len(dsts)]
        b = self.config.block_size
        with self._lock:
            self.check_open()
            self._num_retrieve_calls += 1
            self._num_tokens_requested += len(keys) * b
            plan = self._stack.plan_load([k.block_hash for k in keys])
            num_ok, counts = self._stack.load(keys, dsts, plan)
            self._stack.promote(keys, list(dsts), plan, num_ok)
            self._num_tokens_hit += num_ok * b
            return LoadResult(num_ok, counts)

    # -- background work: prefetch and the asyncio API -------------------------------------
    @contextlib.contextmanager
    def _outside_lock(self) -> Iterator[None]:
        """Use the tiers without the store's lock. Raises `StoreClosedError` once close() has
        begun; close() waits for every such use to end before it closes the tiers."""
        with self._workers_lock:
            if self._closing:
                raise StoreClosedError("KVCacheStore is closed")
            self._num_outside += 1
        try:
            yield
        finally:
            with self._workers_lock:
                self._num_outside -= 1
                self._workers_lock.notify_all()

    def _submit(self, fn: Callable[..., R], *args: object, **kwargs: object) -> Future[R]:
        """Queue `fn` on the I/O threads (started on first use); `StoreClosedError` once close()
        has begun."""
        with self._workers_lock:
            if self._closing:
                raise StoreClosedError("KVCacheStore is closed")
            if self._workers is None:
                self._workers = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvstrata-io")
            return self._workers.submit(fn, *args, **kwargs)

    def prefetch(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> Future[int]:
        """Bring the longest cached prefix of `tokens` from the slow tiers (disk, remote) into
        the fastest memory tier below the pool (the CPU tier; the pool without one), in the
        background. The future resolves to the leading tokens then held in memory tiers.

        Bad input raises here, at once, as does `StoreClosedError` once `close()` has begun.
        The slow reads run without the store's lock (other calls proceed meanwhile); only the
        final insert takes it, and inserts nothing if `clear()` ran since the reads began. A
        prefetch that `close()` finds queued or running resolves to 0 (never cancelled).
        """
        self.check_open()
        arr, hashes = self._hash(tokens, extra_keys)
        keys = self.block_keys(arr, hashes)
        return self._submit(self._prefetch, keys)

    def _prefetch(self, keys: list[BlockKey]) -> int:
        try:
            with self._outside_lock():
                return self._prefetch_reads(keys)
        except StoreClosedError:  # close() began: a queued or running prefetch resolves to 0
            return 0

    def _prefetch_reads(self, keys: list[BlockKey]) -> int:
        tiers = self._stack.tiers
        memory = [i for i, t in enumerate(tiers) if t.kind in (TierKind.POOL, TierKind.CPU)]
        slow = {i for i, t in enumerate(tiers) if t.kind in (TierKind.DISK, TierKind.REMOTE)}
        hashes = [k.block_hash for k in keys]
        with self._lock:
            if self._closing:  # close() began: resolve to 0
                return 0
            generation = self._generation  # what the reads below see; a clear() later voids them
            plan = self._stack.locate(hashes)
        target = memory[-1] if memory else None
        fetch = [i for i, t in enumerate(plan) if t in slow]
        if target is not None and fetch:
            buffer = BlockBatch(torch.empty((len(fetch), *self.config.block_shape), dtype=self.config.layout.dtype))
            got = 0
            sources: list[tuple[TierKind, int]] = []
            while got < len(fetch) and not self._closing:  # one read per run of one tier, in prefix order
                end, tier = got, plan[fetch[got]]
                while end < len(fetch) and plan[fetch[end]] == tier and fetch[end] - fetch[got] == end - got:
                    end += 1
                n = tiers[tier].get_into([keys[i] for i in fetch[got:end]], buffer[got:end])
                sources.append((tiers[tier].kind, n))
                got += n
                if got < end:
                    break
            with self._lock:
                if self._closing:
                    return 0
                if got and generation == self._generation:
                    # DiskFullError: a tier below refused what the insert would evict; nothing moved
                    with contextlib.suppress(DiskFullError):
                        tiers[target].put([keys[i] for i in reversed(fetch[:got])], buffer[got - 1 :: -1])
                        self.num_prefetched_blocks += got
                        for kind, n in sources:
                            self.prefetched_blocks[kind] = self.prefetched_blocks.get(kind, 0) + n
        with self._lock:
            if self._closing:
                return 0
            plan = self._stack.locate(hashes)
        leading = next((i for i, t in enumerate(plan) if t not in memory), len(plan))
        return leading * self.config.block_size

    def _unless_closing(self, fn: Callable[..., R], *args: object, **kwargs: object) -> R:
        if self._closing:  # queued when close() began: not run
            raise StoreClosedError("KVCacheStore is closed")
        return fn(*args, **kwargs)

    async def _in_thread(self, fn: Callable[..., R], *args: object, **kwargs: object) -> R:
        loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._submit(self._unless_closing, fn, *args, **kwargs), loop=loop)

    async def astore(self, tokens: object, kv: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """`store` on the store's I/O threads (`StoreConfig.io_threads` at a time), for event
        loops: the loop never blocks on a copy or a disk write. Stores nothing (returns 0) if
        `clear()` runs between this call and its turn on a thread.

        The asyncio calls raise `StoreClosedError` when `close()` has begun before they ran
        (never `asyncio.CancelledError`); one already running completes."""
        return await self._in_thread(self.store, tokens, kv, extra_keys=extra_keys, generation=self._generation)

    async def aretrieve(self, tokens: object, *, extra_keys: ExtraKeys | None = None,
                        device: torch.device | str | None = None, out: torch.Tensor | None = None) -> RetrieveResult:
        """`retrieve` on the store's I/O threads (see `astore`)."""
        return await self._in_thread(self.retrieve, tokens, extra_keys=extra_keys, device=device, out=out)

    async def alookup(self, tokens: object, *, extra_keys: ExtraKeys | None = None) -> int:
        """`lookup` on the store's I/O threads (see `astore`)."""
        return await self._in_thread(self.lookup, tokens, extra_keys=extra_keys)

    def check_integrity(self) -> None:
        """Raise `RuntimeError` if any tier's invariants are broken (a bug)."""
        with self._lock:
            self.check_open()
            self._stack.check_integrity()

    def flush(self) -> bool:
        """Return once every block stored so far is visible to other hosts (the remote tier's
        background writes sent, or dropped for a fault and counted). False on a timeout."""
        self.check_open()
        with self._outside_lock():  # close() waits for it to end before closing the tiers
            return self._stack.flush()

    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete this store's blocks from every tier. The disk tier may be shared: only this
        namespace's records go, unless `all_namespaces` (every record in `disk_path`, whoever
        wrote it: a whole-directory wipe).

        Work begun before the clear never brings its bytes back after it: a running `prefetch`
        inserts nothing, a queued `astore` stores nothing, nor does a `store` / `store_blocks`
        given an older `generation`."""
        with self._lock:
            self.check_open()
            self._generation += 1
            for tier in self._stack.tiers:
                if isinstance(tier, (LMDBTier, RemoteTier)):
                    tier.clear(all_namespaces=all_namespaces)
                else:
                    tier.clear()
                if self.events is not None:
                    self.events.on_clear(tier.kind)

    def scrub(self) -> ScrubResult | None:
        """Validate every disk record; delete damaged ones (of any namespace: they are garbage
        to every reader). Sound records of other namespaces are left alone. None without a
        disk tier."""
        with self._lock:
            self.check_open()
            disks = [t for t in self._stack.tiers if isinstance(t, LMDBTier)]
            return disks[0].scrub() if disks else None

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
        with self._close_lock:
            with self._workers_lock:
                self._closing = True  # from here no work is queued, and queued work does nothing
                workers, self._workers = self._workers, None
            if workers is not None:
                workers.shutdown(wait=True)
            with self._workers_lock:
                while self._num_outside:  # reads and flushes without the store's lock
                    self._workers_lock.wait()
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

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """Raise `StoreClosedError` if the store was closed."""
        if self._closed:
            raise StoreClosedError("KVCacheStore is closed")
