"""`BlockAPI`: the store as engines that page KV in blocks see it (`KVCacheStore.blocks`).

An engine that pages KV in blocks of its own (the vLLM worker) saves and loads whole blocks
of a request (`save`, `load`) and asks where its cached prefix lies (`locate`). A model runner
that attends over the store's block pool (the reference runner's block manager) also asks
which blocks of a request the pool caches, takes pool blocks, fills them from the tiers below,
registers and releases them. Tiers are named by `TierKind`, never by position, and the pool's
own structures stay inside the pool. Every call takes the store's lock; `locked()` holds it
across several calls that must see one state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.hashing import BlockChain, BlockHash, ExtraKeys
from kvstore.results import LoadResult
from kvstore.timing import timed
from kvstore.validate import check_blocks
from tiers.base import BlockKey, TierKind
from tiers.free_queue import PoolBlock
from tiers.gpu_pool import BlockPool, NoFreeBlocksError

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvstore.store import KVCacheStore


class PrefixMatch(NamedTuple):
    """A request's cached prefix: the leading blocks cached in the pool (token ids verified),
    then the tier below the pool holding each following block."""

    pool_blocks: list[PoolBlock]
    lower: list[TierKind]


class PoolFill(NamedTuple):
    """What `allocate` did: the blocks taken (in order), how many leading ones it filled from
    the tiers below (and registered as cached), and how many each tier served."""

    blocks: list[PoolBlock]
    num_filled: int
    blocks_per_tier: dict[TierKind, int]


class BlockAPI:
    """Block-level access to one store; see the module docstring. The pool calls raise
    `ConfigError` on a store without a block pool."""

    def __init__(self, store: KVCacheStore) -> None:
        self.store = store
        self.block_size = store.config.block_size

    @property
    def _pool(self) -> BlockPool:
        pool = self.store.pool
        if pool is None:
            raise ConfigError("this call needs a store with a block pool (StoreConfig.pool_blocks > 0)")
        return pool

    @property
    def pool_kind(self) -> TierKind:
        """The block pool's tier kind (its name in `blocks_per_tier`); `ConfigError` without one."""
        return self._pool.kind

    @property
    def observe_latency(self) -> Callable[[str, float], None] | None:
        return self.store.observe_latency

    # -- whole blocks in and out of an engine's own memory -----------------------------------
    @timed("store")
    def save(self, tokens: object, srcs: Sequence[torch.Tensor], *, first_block: int = 0,
             extra_keys: ExtraKeys | None = None, chain: BlockChain | None = None,
             generation: int | None = None) -> int:
        """Store `srcs[i]` as full block `first_block + i` of `tokens`; return how many were new.

        Each src is one block-shaped tensor (`StoreConfig.block_shape`, the layout's dtype, any
        device). `tokens` must cover every given block; the blocks before `first_block` need not
        be cached or given (their hashes chain into the keys). Writes like `store`: into the top
        tier (and at once into shared and write-through tiers); blocks already held are only
        touched. Invalid input raises an `InvalidInputError` subclass and stores nothing. With
        `generation` older than the store's (a `clear()` ran since), stores nothing: returns 0.
        """
        store = self.store
        store.check_open()
        arr, hashes = store._keyer.hashes(tokens, extra_keys, chain)
        check_blocks(store.config, srcs, len(arr), first_block)
        keys = self._range(arr, hashes, extra_keys, first_block, len(srcs))
        with store.lock:
            store.check_open()
            current = store._current(generation)  # raises for a bad value before anything counts
            store._counters.num_store_calls += 1
            if not current:
                return 0
            written = store.stack.put(keys, list(srcs))
            store._counters.num_blocks_stored += written
            return written

    @timed("load")
    def load(self, tokens: object, dsts: Sequence[torch.Tensor], *, first_block: int = 0,
             extra_keys: ExtraKeys | None = None, chain: BlockChain | None = None) -> LoadResult:
        """Copy cached blocks `first_block, first_block + 1, ...` of `tokens` into `dsts`.

        Stops at the first block no tier holds (or that fails validation); `dsts[i]` past that
        are left untouched. Lower-tier hits are promoted into the top tier as in `retrieve`.
        The blocks before `first_block` are neither read nor required.
        """
        store = self.store
        store.check_open()
        arr, hashes = store._keyer.hashes(tokens, extra_keys, chain)
        check_blocks(store.config, dsts, len(arr), first_block, destination=True)
        keys = self._range(arr, hashes, extra_keys, first_block, len(dsts))
        b = self.block_size
        with store.lock:
            store.check_open()
            store._counters.num_retrieve_calls += 1
            store._counters.num_tokens_requested += len(keys) * b
            plan = store.stack.plan_load([k.block_hash for k in keys])
            num_ok, counts = store.stack.load(keys, dsts, plan)
            store.stack.promote(keys, list(dsts), plan, num_ok)
            store._counters.num_tokens_hit += num_ok * b
            return LoadResult(num_ok, counts)

    def _range(self, arr: np.ndarray, hashes: list[BlockHash], extra_keys: ExtraKeys | None, first: int,
               count: int) -> list[BlockKey]:
        """The keys of blocks `first .. first + count - 1` (only those are built)."""
        b = self.block_size
        return self.store.block_keys(arr[first * b : (first + count) * b], hashes[first : first + count], extra_keys,
                                     first_block=first, parent=hashes[first - 1] if first else None)

    # -- hashing -----------------------------------------------------------------------------
    def chain(self, extra_keys: ExtraKeys | None = None) -> BlockChain:
        """A `BlockChain` in the store's namespace, to hash one growing request once."""
        return self.store.chain(extra_keys)

    def keys(self, chain: BlockChain, tokens: np.ndarray, start: int, end: int) -> list[BlockKey]:
        """The `BlockKey`s of blocks `start .. end - 1` of the sequence `chain` hashed, whose
        tokens from block `start` on are `tokens`: with their token ids when the store verifies
        them, and their parent and extras when it publishes KV events."""
        hashes = chain.hashes
        if start >= end:
            return []
        return self.store.block_keys(tokens, hashes[start:end], chain.extra_keys, first_block=start,
                                     parent=hashes[start - 1] if start else None)

    @contextlib.contextmanager
    def locked(self, *, require_open: bool = True) -> Iterator[None]:
        """Hold the store's lock (re-entrant) across several calls; `StoreClosedError` if the
        store is closed, unless `require_open` is False."""
        with self.store.lock:
            if require_open:
                self.store.check_open()
            yield

    # -- where cached blocks are -----------------------------------------------------------
    def locate(self, hashes: Sequence[BlockHash]) -> list[TierKind]:
        """The fastest tier holding each block of the longest cached prefix. Changes nothing."""
        with self.locked():
            tiers = self.store.stack.tiers
            return [tiers[i].kind for i in self.store.stack.locate(hashes)]

    def cached_prefix(self, keys: Sequence[BlockKey]) -> list[PoolBlock]:
        """The longest prefix of `keys` cached in the pool whose stored token ids (if both
        sides have them) are the keys' own; changes nothing (no reference is taken)."""
        with self.locked():
            blocks = self._pool.get_cached_blocks([k.block_hash for k in keys])
            for i, block in enumerate(blocks):
                if keys[i].tokens and block.tokens and block.tokens != keys[i].tokens:
                    return blocks[:i]  # other token ids under this hash: a miss from here
            return blocks

    def match(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        """The longest cached prefix of `keys` (see `PrefixMatch`). A pool block whose token
        ids differ from the key's ends the prefix there. Changes nothing."""
        with self.locked():
            pool_blocks = self.cached_prefix(keys)
            n = len(pool_blocks)
            hashes = [k.block_hash for k in keys]
            if n < len(keys) and self._pool.match_prefix(hashes, n):
                return PrefixMatch(pool_blocks, [])  # the pool holds other tokens under this key
            lower = self.locate(hashes)[n:]
            # Blocks come from below the pool only: one the pool holds after a block it lacks
            # (the chain's tail outlived its prefix there) ends the prefix.
            cut = next((i for i, kind in enumerate(lower) if kind is self._pool.kind), len(lower))
            return PrefixMatch(pool_blocks, lower[:cut])

    def still_cached(self, hashes: Sequence[BlockHash], blocks: Sequence[PoolBlock]) -> bool:
        """Whether each `blocks[i]` is still the pool's cached block for `hashes[i]`."""
        with self.locked():
            return len(blocks) <= len(hashes) and all(self._pool.holds(h, b) for h, b in zip(hashes, blocks))

    def owns(self, block: object) -> bool:
        """Whether `block` is one of this pool's blocks (for validating caller input)."""
        return isinstance(block, PoolBlock) and self._pool.owns(block)

    # -- pool blocks -------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int, acquiring: Sequence[PoolBlock] = ()) -> bool:
        """Whether `num_blocks` new blocks can be taken after `acquire(acquiring)`."""
        with self.locked():
            reused_free = sum(1 for b in acquiring if b.ref_cnt == 0)  # they leave the free queue
            return num_blocks + reused_free <= self._pool.num_free_blocks

    def acquire(self, blocks: Sequence[PoolBlock]) -> None:
        """Take a reference on each cached block (shared by every request using it)."""
        with self.locked():
            self._pool.touch_blocks(blocks)

    def allocate(self, num_blocks: int, fill: Sequence[BlockKey] = (), kinds: Sequence[TierKind] = ()) -> PoolFill:
        """Take `num_blocks` free blocks; fill the first `len(fill)` with those cached blocks
        from the tiers `kinds` names (one per key, below the pool), register the filled ones
        as cached, and stop filling at the first block missing or failing validation.

        The blocks to fill are pinned in their tiers while the pool makes room (its evictions
        demote into those tiers and must not push them out), and re-located after it (a block
        may have moved down a tier meanwhile). Raises `NoFreeBlocksError`, changing nothing,
        if the pool has fewer free blocks; `InvalidInputError` if `fill` and `kinds` differ in
        length, name a tier the store lacks or the pool, or exceed `num_blocks`.
        """
        if len(fill) != len(kinds) or len(fill) > num_blocks:
            raise InvalidInputError(f"allocate: {len(fill)} keys to fill, {len(kinds)} tiers, {num_blocks} blocks")
        with self.locked():
            stack = self.store.stack
            held = {t.kind: t for t in stack.tiers}
            if any(k not in held or held[k].traits.engine_memory for k in kinds):
                raise InvalidInputError(f"allocate: tiers {sorted(set(kinds))} are not all tiers below the pool")
            if num_blocks > self._pool.num_free_blocks:
                raise NoFreeBlocksError(f"need {num_blocks} blocks, {self._pool.num_free_blocks} free")
            hashes = [k.block_hash for k in fill]
            pinned = [(kind, stack.pin(kind, [h for h, k in zip(hashes, kinds) if k == kind])) for kind in set(kinds)]
            try:
                blocks = self._pool.allocate(num_blocks)
                num_filled, per_tier = self._fill(fill, blocks[: len(fill)])
            finally:
                for kind, held_hashes in pinned:
                    stack.unpin(kind, held_hashes)
            return PoolFill(blocks, num_filled, per_tier)

    def _fill(self, keys: Sequence[BlockKey], blocks: Sequence[PoolBlock]) -> tuple[int, dict[TierKind, int]]:
        stack = self.store.stack
        plan = stack.locate([k.block_hash for k in keys])
        end = next((i for i, t in enumerate(plan) if stack.tiers[t].traits.engine_memory), len(plan))
        views = [self._pool.block_view(b.block_id) for b in blocks[:end]]
        got, counts = stack.load(keys[:end], views, plan[:end])
        self._pool.cache_blocks(blocks[:got], keys[:got])
        return got, counts

    def register(self, blocks: Sequence[PoolBlock], keys: Sequence[BlockKey]) -> int:
        """Register full blocks whose KV is written as cached under `keys`; return how many
        were new (a hash another block caches already is left to that block)."""
        with self.locked():
            return self._pool.cache_blocks(blocks, keys)

    def release(self, blocks: Sequence[PoolBlock]) -> None:
        """Drop one reference on each of a request's blocks (request order); blocks reaching
        0 become evictable, the sequence's tail first."""
        with self.locked():
            self._pool.free_blocks(blocks)

    # -- the pool's memory -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def device(self) -> torch.device:
        return self._pool.device

    @property
    def kv_cache(self) -> torch.Tensor:
        """The paged KV tensor `[num_layers, 2, num_blocks, block_size, heads, head_dim]`."""
        return self._pool.kv_cache
