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
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.hashing import BlockHash, ExtraKeys, as_token_array, chain_hashes
from kvstore.store import KVCacheStore
from tiers.base import TierKind
from tiers.gpu_pool import BlockPool, NoFreeBlocksError, PoolBlock


class ComputedBlocks(NamedTuple):
    """The cached prefix of a request, as `get_computed_blocks` found it (nothing moved yet).

    Attributes:
        num_tokens: tokens whose KV is cached somewhere, a multiple of block_size.
        pool_blocks: leading blocks cached in the pool (shared by reference).
        lower_plan: tier index (into `store.tiers`) of each following block to load.
    """

    num_tokens: int
    pool_blocks: list[PoolBlock]
    lower_plan: list[int]


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
    extra_keys: ExtraKeys | None
    hashes: list[BlockHash] = field(default_factory=list)
    blocks: list[PoolBlock] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in the pool's cache
    num_computed_tokens: int = 0


def _check_count(name: str, value: object) -> int:
    return require_int(name, value, 0, InvalidInputError)


def _check_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidInputError(f"request_id must be a str, got {type(request_id).__name__}")
    return request_id


class KVCacheManager:
    """Block tables for running requests; all pool mutation goes through the store's lock.

    Bad arguments raise `InvalidInputError` and change nothing.
    """

    def __init__(self, store: KVCacheStore) -> None:
        if store.pool is None:
            raise ConfigError("KVCacheManager needs a store with a block pool (StoreConfig.pool_blocks > 0)")
        self.store = store
        self.pool: BlockPool = store.pool
        self.block_size = store.config.block_size
        self._requests: dict[str, _Request] = {}

    # -- request lifecycle -----------------------------------------------------------------
    def add_request(self, request_id: str, token_ids: object, extra_keys: ExtraKeys | None = None) -> None:
        """Register a request's prompt. Raises `InvalidInputError` for a duplicate id."""
        self.store.check_open()
        if _check_id(request_id) in self._requests:  # checked again under the lock below
            raise InvalidInputError(f"request {request_id!r} already exists")
        if extra_keys is not None and not isinstance(extra_keys, ExtraKeys):
            raise InvalidInputError(f"extra_keys must be ExtraKeys or None, got {type(extra_keys).__name__}")
        arr = as_token_array(token_ids)
        req = _Request(arr.tolist(), extra_keys)
        self._extend_hashes(req)
        with self.store.lock:  # two threads adding one id: exactly one wins
            if request_id in self._requests:
                raise InvalidInputError(f"request {request_id!r} already exists")
            self._requests[request_id] = req

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append generated tokens (their KV is not computed yet)."""
        req = self._req(request_id)
        req.token_ids.extend(as_token_array(token_ids).tolist())
        self._extend_hashes(req)

    def _extend_hashes(self, req: _Request) -> None:
        b = self.block_size
        done = len(req.hashes)
        tail = as_token_array(req.token_ids[done * b :])
        if len(tail) < b:
            return
        parent = req.hashes[-1] if req.hashes else self.store.seed
        cfg = self.store.config
        req.hashes.extend(chain_hashes(tail, b, parent, req.extra_keys, cfg.hash_algo, first_block=done))

    def _req(self, request_id: str) -> _Request:
        self.store.check_open()
        try:
            return self._requests[_check_id(request_id)]
        except KeyError:
            raise InvalidInputError(f"unknown request {request_id!r}") from None

    # -- ask / act ---------------------------------------------------------------------------
    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        """Longest cached prefix (pool first, then lower tiers). Changes nothing.

        At least the last prompt token is always left to compute (its logits are needed).
        """
        req = self._req(request_id)
        limit = (len(req.token_ids) - 1) // self.block_size
        hashes = req.hashes[:limit]
        with self.store.lock:
            pool_blocks = self.pool.get_cached_blocks(hashes)
            num_ok = self._num_tokens_match(req, pool_blocks)
            if num_ok < len(pool_blocks):  # other token ids under our hash: a miss from there
                pool_blocks, hashes = pool_blocks[:num_ok], hashes[:num_ok]
            plan = self.store.stack.locate(hashes)
        lower = plan[len(pool_blocks) :]
        # Load or recompute: the store's policy keeps the leading blocks worth loading.
        lower = lower[: self.store.load_policy.blocks_to_load([self.store.tiers[i].kind for i in lower])]
        return ComputedBlocks((len(pool_blocks) + len(lower)) * self.block_size, pool_blocks, lower)

    def _current(
        self, request_id: str, num_new_tokens: int, computed: ComputedBlocks | None
    ) -> tuple[_Request, int, ComputedBlocks | None]:
        """Validated arguments, with a `computed` the pool no longer matches (blocks evicted or
        reused since `get_computed_blocks`) looked up again, keeping the total tokens fixed."""
        req = self._req(request_id)
        num_new_tokens = _check_count("num_new_tokens", num_new_tokens)
        self._check_computed(computed)
        with self.store.lock:
            if computed is not None and not req.blocks and not self._is_current(req, computed):
                total = computed.num_tokens + num_new_tokens
                computed = self.get_computed_blocks(request_id)
                num_new_tokens = max(0, total - computed.num_tokens)
        return req, num_new_tokens, computed

    def num_blocks_needed(self, request_id: str, num_new_tokens: int, computed: ComputedBlocks | None) -> int:
        """Blocks `allocate_slots` would take from the free queue (pool hits excluded)."""
        with self.store.lock:
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
        with self.store.lock:
            req, num_new_tokens, computed = self._current(request_id, num_new_tokens, computed)
            return self._can_allocate(req, num_new_tokens, computed)

    def _can_allocate(self, req: _Request, num_new_tokens: int, computed: ComputedBlocks | None) -> bool:
        need = self._num_needed(req, num_new_tokens, computed)
        shared_free = 0
        if computed is not None and not req.blocks:  # pool hits at ref 0 leave the free queue
            shared_free = sum(1 for b in computed.pool_blocks if b.ref_cnt == 0)
        return need + shared_free <= len(self.pool.free_queue)

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
        with self.store.lock:
            req, num_new_tokens, computed = self._current(request_id, num_new_tokens, computed)
            need = self._num_needed(req, num_new_tokens, computed)
            if not self._can_allocate(req, num_new_tokens, computed):
                raise NoFreeBlocksError(
                    f"request {request_id!r} needs {need} blocks; {len(self.pool.free_queue)} free"
                )
            per_tier: dict[TierKind, int] = {}
            first_call = computed is not None and not req.blocks
            if first_call:
                assert computed is not None
                self.pool.touch_blocks(computed.pool_blocks)
                req.blocks.extend(computed.pool_blocks)
                req.num_cached_blocks = len(computed.pool_blocks)
                if computed.pool_blocks:
                    per_tier[TierKind.POOL] = len(computed.pool_blocks)
                req.num_computed_tokens = len(computed.pool_blocks) * self.block_size
            lower = computed.lower_plan if first_call and computed is not None else []
            # Allocation demotes pool victims into the CPU tier, which must not push out the
            # CPU blocks this request is about to load: pin them until they are loaded.
            pinned = self._pin_planned(req, len(req.blocks), lower)
            try:
                new_blocks = self.pool.allocate(need)
                req.blocks.extend(new_blocks)
                if lower:
                    self._load_lower(req, len(req.blocks) - len(new_blocks), len(lower), per_tier)
            finally:
                for index, hashes in pinned:
                    self.store.stack.unpin(index, hashes)
            return Allocation(req.num_computed_tokens, new_blocks, per_tier)

    def _check_computed(self, computed: object) -> None:
        """A `ComputedBlocks` as `get_computed_blocks` makes them: this pool's blocks and a plan
        of lower-tier indices (checked before any reference is taken)."""
        if computed is None:
            return
        num_tiers = len(self.store.tiers)
        if not (isinstance(computed, ComputedBlocks) and isinstance(computed.num_tokens, int)
                and not isinstance(computed.num_tokens, bool)
                and isinstance(computed.pool_blocks, list) and isinstance(computed.lower_plan, list)
                and computed.num_tokens >= 0
                and all(isinstance(b, PoolBlock) and 0 <= b.block_id < self.pool.num_blocks
                        and self.pool.blocks[b.block_id] is b for b in computed.pool_blocks)
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < num_tiers
                        for t in computed.lower_plan)):
            raise InvalidInputError(f"computed must come from get_computed_blocks, got {computed!r}")

    def _num_tokens_match(self, req: _Request, blocks: Sequence[PoolBlock]) -> int:
        """Leading pool blocks whose stored token ids are the request's (verify_tokens)."""
        if not self.store.config.verify_tokens:
            return len(blocks)
        b = self.block_size
        buf = np.asarray(req.token_ids[: len(blocks) * b], dtype="<u4").tobytes()
        for i, block in enumerate(blocks):
            if block.tokens and block.tokens != buf[i * b * 4 : (i + 1) * b * 4]:
                return i
        return len(blocks)

    def _is_current(self, req: _Request, computed: ComputedBlocks) -> bool:
        """Whether `computed` still describes `req`'s cached prefix in the pool (lock held)."""
        n = len(computed.pool_blocks)
        num_blocks = n + len(computed.lower_plan)
        return (
            num_blocks <= max(0, (len(req.token_ids) - 1) // self.block_size)
            and computed.num_tokens == num_blocks * self.block_size
            and all(self.pool.cached.get(h) is b for h, b in zip(req.hashes, computed.pool_blocks))
            and self._num_tokens_match(req, computed.pool_blocks) == n
        )

    def _pin_planned(self, req: _Request, first: int, plan: list[int]) -> list[tuple[int, list[BlockHash]]]:
        """Pin the planned blocks in their tiers (those that evict under a reader pin them).
        Exactly the blocks pinned are returned: one gone since the plan (evicted, or deleted as
        damaged) is skipped, and the ones after it are still unpinned later."""
        pinned = []
        for index in sorted(set(plan)):
            hashes = [req.hashes[first + i] for i, t in enumerate(plan) if t == index]
            pinned.append((index, self.store.stack.pin(index, hashes)))
        return pinned

    def _load_lower(self, req: _Request, first: int, count: int, per_tier: dict[TierKind, int]) -> None:
        """Load blocks `first .. first + count` from the tiers below the pool into the
        request's blocks, re-planned now (allocation may have moved blocks down a tier);
        stop at the first block missing or failing validation."""
        end = first + count
        plan = self.store.stack.locate(req.hashes[:end])[first:]
        end = first + next((i for i, t in enumerate(plan) if t == 0), len(plan))  # lower tiers only
        arr = np.asarray(req.token_ids[: end * self.block_size], dtype="<u4")
        keys = self.store.block_keys(arr, req.hashes[:end], req.extra_keys)
        views = [self.pool.block_view(b.block_id) for b in req.blocks[first:end]]
        got, counts = self.store.stack.load(keys[first:end], views, plan[: end - first])
        for kind, n in counts.items():
            per_tier[kind] = per_tier.get(kind, 0) + n
        pos = first + got
        self.pool.cache_blocks(req.blocks[first:pos], req.hashes[first:pos], [k.tokens for k in keys[first:pos]])
        req.num_cached_blocks = pos
        req.num_computed_tokens = pos * self.block_size

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
        arr = np.asarray(req.token_ids[: full * self.block_size], dtype="<u4")
        keys = self.store.block_keys(arr, req.hashes[:full], req.extra_keys)
        start = req.num_cached_blocks
        with self.store.lock:
            n = self.pool.cache_blocks(req.blocks[start:full], req.hashes[start:full],
                                       [k.tokens for k in keys[start:full]])
        req.num_cached_blocks = full
        return n

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first into the free queue) and forget it.

        After the store was closed this only forgets the request (its pool is gone).
        """
        with self.store.lock:
            if self.store.closed:
                if self._requests.pop(_check_id(request_id), None) is None:
                    raise InvalidInputError(f"unknown request {request_id!r}")
                return
            req = self._requests.pop(_check_id(request_id), None)
            if req is None:
                raise InvalidInputError(f"unknown request {request_id!r}")
            self.pool.free_blocks(req.blocks)

    # -- views -------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req(request_id).blocks]

    def num_computed_tokens(self, request_id: str) -> int:
        return self._req(request_id).num_computed_tokens

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._req(request_id).token_ids)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and request_id in self._requests
