"""`KVCacheManager`: per-request block tables over the store's block pool.

The layer a model runner talks to. For each request it finds the longest cached prefix
through every tier (pool hits are shared by reference; CPU and disk hits are loaded into
fresh pool blocks), allocates blocks for the tokens to compute, registers full blocks once
their KV is written (`commit`), and frees the request's blocks when it finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvstore.config import require_int
from kvstore.errors import InvalidInputError
from kvstore.hashing import BlockChain, BlockHash, ExtraKeys, as_token_array
from kvstore.store import KVCacheStore
from tiers.keys import BlockKey, TierKind
from tiers.pool.free_queue import PoolBlock
from tiers.pool.gpu_pool import NoFreeBlocksError


class ComputedBlocks(NamedTuple):
    """The cached prefix of a request, as `get_computed_blocks` found it (nothing moved yet).

    Attributes:
        num_tokens: tokens whose KV is cached somewhere, a multiple of block_size.
        pool_blocks: leading blocks cached in the pool (shared by reference).
        lower_plan: the tier below the pool holding each following block to load.
    """

    num_tokens: int
    pool_blocks: list[PoolBlock]
    lower_plan: list[TierKind]


class Allocation(NamedTuple):
    """What `allocate_slots` did.

    Attributes:
        num_computed_tokens: tokens whose KV is in the request's blocks now; the runner
            computes from here (a lower-tier block that failed validation shortens it).
        new_blocks: blocks appended to the request's block table.
        blocks_per_tier: cached blocks reused, by the tier that served them.
    """

    num_computed_tokens: int
    new_blocks: list[PoolBlock]
    blocks_per_tier: dict[TierKind, int]


@dataclass
class _Request:
    token_ids: list[int]
    chain: BlockChain  # the keys of its full blocks, hashed once as they complete
    blocks: list[PoolBlock] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in the pool's cache
    num_computed_tokens: int = 0

    @property
    def hashes(self) -> list[BlockHash]:
        return self.chain.hashes


def _check_count(name: str, value: object) -> int:
    return require_int(name, value, 0, InvalidInputError)


def _check_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidInputError(f"request_id must be a str, got {type(request_id).__name__}")
    return request_id


class KVCacheManager:
    """Block tables for running requests over the store's `PoolAllocator`; every change to
    the pool happens under the store's lock (`PoolAllocator.locked`).

    Bad arguments raise `InvalidInputError` and change nothing.
    """

    def __init__(self, store: KVCacheStore) -> None:
        self.store = store
        self.allocator = store.allocator  # ConfigError without a block pool
        self.block_size = store.config.block_size
        self._requests: dict[str, _Request] = {}

    # -- request lifecycle -----------------------------------------------------------------
    def add_request(self, request_id: str, token_ids: object, extra_keys: ExtraKeys | None = None) -> None:
        """Register a request's prompt. Raises `InvalidInputError` for a duplicate id."""
        self.store.check_open()
        if _check_id(request_id) in self._requests:  # checked again under the lock below
            raise InvalidInputError(f"request {request_id!r} already exists")
        req = _Request(as_token_array(token_ids).tolist(), self.store.chain(extra_keys))
        self._extend_hashes(req)
        with self.allocator.locked():  # two threads adding one id: exactly one wins
            if request_id in self._requests:
                raise InvalidInputError(f"request {request_id!r} already exists")
            self._requests[request_id] = req

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append generated tokens (their KV is not computed yet)."""
        req = self._req(request_id)
        req.token_ids.extend(as_token_array(token_ids).tolist())
        self._extend_hashes(req)

    def _extend_hashes(self, req: _Request) -> None:
        """Hash the blocks completed since the last call (each block once)."""
        b = self.block_size
        done, full = len(req.hashes), len(req.token_ids) // b
        if full > done:
            req.chain.extend(as_token_array(req.token_ids[done * b : full * b]))

    def _req(self, request_id: str) -> _Request:
        self.store.check_open()
        try:
            return self._requests[_check_id(request_id)]
        except KeyError:
            raise InvalidInputError(f"unknown request {request_id!r}") from None

    def _keys(self, req: _Request, start: int, end: int) -> Sequence[BlockKey]:
        """The keys of blocks `start .. end - 1` of the request (with their token ids)."""
        if start >= end:
            return []
        tokens = np.asarray(req.token_ids[: end * self.block_size], dtype="<u4")
        return self.store.keys(tokens, extra_keys=req.chain.extra_keys, chain=req.chain, first_block=start,
                               num_blocks=end - start)

    # -- ask / act ---------------------------------------------------------------------------
    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        """Longest cached prefix (pool first, then lower tiers). Changes nothing.

        At least the last prompt token is always left to compute (its logits are needed).
        """
        req = self._req(request_id)
        limit = (len(req.token_ids) - 1) // self.block_size
        pool_blocks, lower = self.allocator.match(self._keys(req, 0, limit))
        # Load or recompute: the store's policy keeps the leading blocks worth loading.
        lower = lower[: self.store.load_policy.blocks_to_load(lower)]
        return ComputedBlocks((len(pool_blocks) + len(lower)) * self.block_size, pool_blocks, lower)

    def _current(
        self, request_id: str, num_new_tokens: int, computed: ComputedBlocks | None
    ) -> tuple[_Request, int, ComputedBlocks | None]:
        """Validated arguments, with a `computed` the pool no longer matches (blocks evicted or
        reused since `get_computed_blocks`) looked up again, keeping the total tokens fixed."""
        req = self._req(request_id)
        num_new_tokens = _check_count("num_new_tokens", num_new_tokens)
        self._check_computed(computed)
        with self.allocator.locked():
            if computed is not None and not req.blocks and not self._is_current(req, computed):
                total = computed.num_tokens + num_new_tokens
                computed = self.get_computed_blocks(request_id)
                num_new_tokens = max(0, total - computed.num_tokens)
        return req, num_new_tokens, computed

    def num_blocks_needed(self, request_id: str, num_new_tokens: int, computed: ComputedBlocks | None) -> int:
        """Blocks `allocate_slots` would take from the free queue (pool hits excluded)."""
        with self.allocator.locked():
            req, num_new_tokens, computed = self._current(request_id, num_new_tokens, computed)
            return self._num_needed(req, num_new_tokens, computed)

    def _num_needed(self, req: _Request, num_new_tokens: int, computed: ComputedBlocks | None) -> int:
        if computed is not None and not req.blocks:  # the first call: from the cached prefix
            start, held = computed.num_tokens, len(computed.pool_blocks)
        else:
            start, held = req.num_computed_tokens, len(req.blocks)
        total = -(-(start + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def can_allocate(self, request_id: str, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now."""
        with self.allocator.locked():
            req, num_new_tokens, computed = self._current(request_id, num_new_tokens, computed)
            return self._can_allocate(req, num_new_tokens, computed)

    def _can_allocate(self, req: _Request, num_new_tokens: int, computed: ComputedBlocks | None) -> bool:
        reused = computed.pool_blocks if computed is not None and not req.blocks else []
        return self.allocator.can_allocate(self._num_needed(req, num_new_tokens, computed), reused)

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation:
        """Give the request blocks for `num_new_tokens` more tokens.

        With `computed` (the request's first call): take references on its pool hits, and
        load its lower-tier hits into newly allocated blocks (registered as cached). A
        `computed` that no longer matches the pool (blocks evicted or reused since
        `get_computed_blocks`, e.g. by a `store()` in between) is looked up again, keeping
        `computed.num_tokens + num_new_tokens` fixed. Raises `NoFreeBlocksError` and changes
        nothing if the pool is short.
        """
        with self.allocator.locked():
            req, num_new_tokens, computed = self._current(request_id, num_new_tokens, computed)
            need = self._num_needed(req, num_new_tokens, computed)
            if not self._can_allocate(req, num_new_tokens, computed):
                raise NoFreeBlocksError(
                    f"request {request_id!r} needs {need} blocks; {self.allocator.num_free_blocks} free"
                )
            per_tier: dict[TierKind, int] = {}
            first_call = computed is not None and not req.blocks
            lower: list[TierKind] = []
            if first_call:
                assert computed is not None
                self.allocator.acquire(computed.pool_blocks)
                req.blocks.extend(computed.pool_blocks)
                req.num_cached_blocks = len(computed.pool_blocks)
                if computed.pool_blocks:
                    per_tier[self.allocator.pool_kind] = len(computed.pool_blocks)
                req.num_computed_tokens = len(computed.pool_blocks) * self.block_size
                lower = computed.lower_plan
            first = len(req.blocks)
            fill = self.allocator.allocate(need, self._keys(req, first, first + len(lower)), lower)
            req.blocks.extend(fill.blocks)
            if lower:
                for kind, n in fill.blocks_per_tier.items():
                    per_tier[kind] = per_tier.get(kind, 0) + n
                req.num_cached_blocks = first + fill.num_filled
                req.num_computed_tokens = req.num_cached_blocks * self.block_size
            return Allocation(req.num_computed_tokens, fill.blocks, per_tier)

    def _check_computed(self, computed: object) -> None:
        """A `ComputedBlocks` as `get_computed_blocks` makes them: this pool's blocks and a plan
        of tiers below the pool (checked before any reference is taken)."""
        if computed is None:
            return
        if not (isinstance(computed, ComputedBlocks) and isinstance(computed.num_tokens, int)
                and not isinstance(computed.num_tokens, bool)
                and isinstance(computed.pool_blocks, list) and isinstance(computed.lower_plan, list)
                and computed.num_tokens >= 0
                and all(self.allocator.owns(b) for b in computed.pool_blocks)
                and all(self.allocator.is_lower_tier(t) for t in computed.lower_plan)):
            raise InvalidInputError(f"computed must come from get_computed_blocks, got {computed!r}")

    def _is_current(self, req: _Request, computed: ComputedBlocks) -> bool:
        """Whether `computed` still describes `req`'s cached prefix in the pool (lock held)."""
        n = len(computed.pool_blocks)
        num_blocks = n + len(computed.lower_plan)
        return (
            num_blocks <= max(0, (len(req.token_ids) - 1) // self.block_size)
            and computed.num_tokens == num_blocks * self.block_size
            and self.allocator.still_cached(req.hashes[:n], computed.pool_blocks)
            and len(self.allocator.cached_prefix(self._keys(req, 0, n))) == n
        )

    def commit(self, request_id: str, num_computed_tokens: int, *, cache_blocks: bool = True) -> int:
        """Record that KV is written up to `num_computed_tokens`; cache the blocks now full.

        With `cache_blocks=False` (prefix caching off) only the progress is recorded.
        Returns how many blocks were newly registered in the pool's cache.
        """
        req = self._req(request_id)
        num_computed_tokens = _check_count("num_computed_tokens", num_computed_tokens)
        limit = min(len(req.token_ids), len(req.blocks) * self.block_size)
        if not 0 <= num_computed_tokens <= limit:
            raise InvalidInputError(f"num_computed_tokens={num_computed_tokens} outside [0, {limit}]")
        req.num_computed_tokens = max(req.num_computed_tokens, num_computed_tokens)
        full = min(req.num_computed_tokens // self.block_size, len(req.hashes))
        if not cache_blocks or full <= req.num_cached_blocks:
            return 0
        start = req.num_cached_blocks
        n = self.allocator.register(req.blocks[start:full], self._keys(req, start, full))
        req.num_cached_blocks = full
        return n

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first into the free queue) and forget it.

        After the store was closed this only forgets the request (its pool is gone).
        """
        with self.allocator.locked(require_open=False):
            req = self._requests.pop(_check_id(request_id), None)
            if req is None:
                raise InvalidInputError(f"unknown request {request_id!r}")
            if not self.store.closed:
                self.allocator.release(req.blocks)

    # -- views -------------------------------------------------------------------------------
    def request_ids(self) -> list[str]:
        """The ids of the requests registered and not yet freed."""
        return list(self._requests)

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """The keys of the request's full blocks (a copy)."""
        return list(self._req(request_id).hashes)

    def num_cached_blocks(self, request_id: str) -> int:
        """Leading blocks of the request registered in the pool's cache."""
        return self._req(request_id).num_cached_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req(request_id).blocks]

    def num_computed_tokens(self, request_id: str) -> int:
        return self._req(request_id).num_computed_tokens

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._req(request_id).token_ids)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and request_id in self._requests
