"""`PoolAllocator`: the store's block pool as a model runner that attends over it sees it.

A runner (the reference runner's block manager) asks which blocks of a request the pool
caches and which tiers below hold the rest (`cached_prefix`, `match`), takes references on
cached blocks (`acquire`), takes free blocks and fills them from the tiers below
(`can_allocate` / `allocate`), registers blocks whose KV it wrote (`register`) and releases a
finished request's blocks (`release`). Tiers are named by `TierKind`, never by position; the
pool's own structures stay inside the pool. It is given the pool, the tier stack, the store's
lock and a check that the store is open, and reads nothing else. Every call takes the lock;
`locked()` holds it across several calls that must see one state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from kvstore.errors import InvalidInputError
from kvstore.tier_stack import TierStack
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.pool.free_queue import PoolBlock
from tiers.pool.gpu_pool import BlockPool, NoFreeBlocksError


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


class PoolAllocator:
    """The pool's allocation calls; see the module docstring. Invariant (the pool's own,
    `BlockPool.check_integrity`): free + cached-unreferenced + referenced = capacity."""

    def __init__(self, pool: BlockPool, stack: TierStack, lock: threading.RLock,
                 check_open: Callable[[], None]) -> None:
        self._pool, self._stack, self._lock, self._check_open = pool, stack, lock, check_open

    @property
    def pool_kind(self) -> TierKind:
        """The block pool's tier kind (its name in `blocks_per_tier`)."""
        return self._pool.kind

    @contextlib.contextmanager
    def locked(self, *, require_open: bool = True) -> Iterator[None]:
        """Hold the store's lock (re-entrant) across several calls; `StoreClosedError` if the
        store is closed, unless `require_open` is False."""
        with self._lock:
            if require_open:
                self._check_open()
            yield

    # -- where cached blocks are -----------------------------------------------------------
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
            tiers = self._stack.tiers
            lower = [tiers[i].kind for i in self._stack.plan_lookup(hashes)][n:]
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

    def is_lower_tier(self, kind: object) -> bool:
        """Whether `kind` names a tier of the store below the pool (one `allocate` fills from)."""
        return isinstance(kind, TierKind) and any(t.kind == kind and not t.traits.engine_memory
                                                  for t in self._stack.tiers)

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
            stack = self._stack
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
        stack = self._stack
        plan = stack.plan_lookup([k.block_hash for k in keys])
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
