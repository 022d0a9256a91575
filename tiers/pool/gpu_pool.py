"""GPU block pool: the store's tier 0 and the paged KV memory a model runner attends over.

One preallocated KV tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(on CUDA when present, else in host memory), one `PoolBlock` per block, a free queue in
eviction order and a map from block hash to cached block, with vLLM v1's semantics:
`get_cached_blocks` (longest cached chain), `touch_blocks` (ref up, out of the free queue),
`allocate` (pop the head; a cached head is evicted, i.e. demoted to the next tier down
before reuse), `cache_blocks` (register full blocks), `free_blocks` (ref down; blocks at 0
join the tail in reverse order, so a sequence's tail is evicted before its prefix).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence

import torch

from tiers.base import Occupancy, Tier, TierCounters, TierTraits, count_held, plan_put
from tiers.changes import ChangeKind
from tiers.errors import DiskFullError, KVStoreError, StoreClosedError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.pool.free_queue import FreeBlockQueue, PoolBlock
from tiers.shared.blockbatch import BlockBatch, copy_rows
from tiers.shared.blockcopy import copy_block, host_memory_bytes, mapped_tensor


class DemotionPolicy(str, enum.Enum):
    """When a pool block's content is copied to the tier below."""

    ON_EVICT = "on_evict"  # copy when the block is reused for other content (default)
    WRITE_THROUGH = "write_through"  # copy when the block is cached; eviction is then free


_STAGING_BYTES = 256 << 20  # device memory a demotion stages blocks through at once


def _memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (physical memory for the host)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return host_memory_bytes()


class NoFreeBlocksError(KVStoreError, RuntimeError):
    """The pool has fewer free blocks than an allocation needs; nothing was allocated."""


class BlockPool(Tier):
    """Fixed pool of KV blocks with reference counts and an LRU free queue.

    Invariant: every block is either referenced (ref_cnt > 0, not in the free queue) or
    free (ref_cnt == 0, in the free queue, cached or not); a cached block's hash maps to it
    in `cached` and to no other block.
    """

    kind = TierKind.POOL
    traits = TierTraits(engine_memory=True, memory=True)

    def __init__(
        self,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        device: torch.device | str | None = None,
        verify_tokens: bool = True,
        demotion: DemotionPolicy = DemotionPolicy.ON_EVICT,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        num_layers, two, block_size, heads, dim = block_shape
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        num_bytes = num_blocks * num_layers * two * block_size * heads * dim * dtype.itemsize
        if num_bytes > _memory_bytes(self.device):  # refuse before zeroing (touching) it all
            raise ValueError(f"{num_blocks} blocks need {num_bytes} bytes, more than {self.device} has")
        shape = (num_layers, two, num_blocks, block_size, heads, dim)
        if self.device.type == "cpu":  # a mapping of its own: close() returns it to the OS
            self.kv_cache = mapped_tensor(shape, dtype)
            self.kv_cache.view(torch.uint8).zero_()  # fault every page in now, as torch.zeros does
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._rows = self.kv_cache.movedim(2, 0)  # [num_blocks, L, 2, b, H, D] view: row i is block i
        self.num_blocks = num_blocks
        self.blocks = [PoolBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, PoolBlock] = {}
        self.demotion = DemotionPolicy(demotion)
        self._verify_tokens = verify_tokens
        self._block_bytes = self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
        self._copy_stream = (  # torch.cuda.Stream's constructor is unannotated
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]  # see above
        )
        self._closed = False
        self.counters = TierCounters()
        self.num_demoted = self.num_demotion_failures = 0

    # -- block handles ---------------------------------------------------------------------
    def block_view(self, block_id: int) -> torch.Tensor:
        """`[num_layers, 2, block_size, heads, head_dim]` view of one block (no copy)."""
        return self.kv_cache[:, :, block_id]

    # -- vLLM v1 operations ----------------------------------------------------------------
    def get_cached_blocks(self, block_hashes: Sequence[BlockHash], start: int = 0) -> list[PoolBlock]:
        """The longest chain of cached blocks for `block_hashes[start:]`. Changes nothing."""
        out = []
        for h in block_hashes[start:]:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def touch_blocks(self, blocks: Sequence[PoolBlock]) -> None:
        """Take a reference on each block; blocks at ref 0 leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (unreferenced, cached or not)."""
        return len(self.free_queue)

    def holds(self, block_hash: BlockHash, block: PoolBlock) -> bool:
        """Whether `block` is the block cached under `block_hash`."""
        return self.cached.get(block_hash) is block

    def owns(self, block: PoolBlock) -> bool:
        """Whether `block` is one of this pool's blocks."""
        return 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block

    def allocate(self, num_blocks: int) -> list[PoolBlock]:
        """Pop `num_blocks` from the head of the free queue with ref 1, evicting cached ones.

        Evicted blocks are demoted to `lower` in one batch (unless write-through already put
        them there). Raises `NoFreeBlocksError` (allocating nothing) if too few are free.
        """
        self._check_open()
        if num_blocks > len(self.free_queue):
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {len(self.free_queue)} free of {self.num_blocks}")
        popped = [self.free_queue.popleft() for _ in range(num_blocks)]
        self._evict([b for b in popped if b.block_hash is not None])
        for block in popped:
            block.ref_cnt = 1
        return popped

    def cache_blocks(self, blocks: Sequence[PoolBlock], keys: Sequence[BlockKey]) -> int:
        """Register full blocks (whose KV is written) under their keys; return how many.

        Each block keeps its whole key (demoted with it). A hash already cached by another
        block is left to that block (this one stays uncached and is reused first once free).
        Write-through demotes the new ones now.
        """
        new, entered = [], []
        for block, key in zip(blocks, keys):
            if block.block_hash is not None or key.block_hash in self.cached:
                continue
            block.cache(key)
            self.cached[key.block_hash] = block
            new.append(block)
            entered.append(key)
        if new and self.demotion is DemotionPolicy.WRITE_THROUGH:
            self._demote(new[::-1])
        self._record(ChangeKind.ENTERED, entered)
        return len(new)

    def free_blocks(self, blocks: Sequence[PoolBlock]) -> None:
        """Drop one reference on each of a request's blocks (given in request order).

        Blocks reaching 0 join the free queue's tail in reverse order: the tail of the
        sequence will be evicted before its prefix.
        """
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free of {block} with no reference (a bug)")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- demotion --------------------------------------------------------------------------
    @staticmethod
    def _key(block: PoolBlock) -> BlockKey:
        key = block.key
        assert key is not None, f"{block} is not cached (a bug)"
        return key

    def _demote(self, blocks: Sequence[PoolBlock]) -> None:
        """Copy blocks (eviction order) down through `below`; a full disk loses them, never fails here."""
        below = self.below
        if below is None or not blocks:
            return
        keys = [self._key(b) for b in blocks]
        try:
            if self._copy_stream is not None:  # D2H on a side stream; wait only for this copy
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._copy_stream):
                    # A gather kernel makes each block contiguous (a block view is
                    # 2 x num_layers strided pieces), so it then leaves in one DMA; staged
                    # in chunks of at most _STAGING_BYTES of device memory.
                    step = max(1, _STAGING_BYTES // self._block_bytes)
                    for start in range(0, len(blocks), step):
                        chunk = blocks[start : start + step]
                        ids = torch.tensor([b.block_id for b in chunk], device=self.device)
                        staged = self.kv_cache.index_select(2, ids).movedim(2, 0).contiguous()
                        below.demote(keys[start : start + step], list(staged))
                self._copy_stream.synchronize()
            else:
                below.demote(keys, [self.block_view(b.block_id) for b in blocks])
            self.num_demoted += len(blocks)
        except DiskFullError:
            self.num_demotion_failures += len(blocks)

    def _evict(self, blocks: Sequence[PoolBlock]) -> None:
        if not blocks:
            return
        below = self.below
        if self.demotion is DemotionPolicy.WRITE_THROUGH and below is not None:
            self._demote([b for b in blocks if b.block_hash is not None and not below.holds(b.block_hash)])
        else:
            self._demote(blocks)
        for block in blocks:
            self._uncache(block)
        self.counters.num_evictions += len(blocks)

    def _uncache(self, block: PoolBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            self._record(ChangeKind.LEFT, [self._key(block)])
            block.uncache()

    # -- the tier protocol -----------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks

    def __len__(self) -> int:
        return len(self.cached)

    def held_hashes(self) -> Iterator[BlockHash]:
        return iter(list(self.cached))

    def held_keys(self) -> Iterator[BlockKey]:
        return iter([k for k in (b.key for b in list(self.cached.values())) if k is not None])

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        return count_held(self.cached, block_hashes, start)

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        ids: list[int] = []
        for key in keys[: len(dsts)]:
            block = self.cached.get(key.block_hash)
            if block is None:
                break
            if self._verify_tokens and key.tokens and block.tokens and block.tokens != key.tokens:
                self.counters.num_corrupt += 1
                self.discard([key.block_hash])
                break
            ids.append(block.block_id)
        n = len(ids)
        if not (isinstance(dsts, BlockBatch) and copy_rows(dsts.rows, dsts.row_ids[:n], self._rows, ids)):
            for dst, block_id in zip(dsts, ids):
                copy_block(dst, self.block_view(block_id))
        return n

    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        self.touch([k.block_hash for k in keys])
        overflow, new = plan_put(keys, self.cached.__contains__, len(self.free_queue))
        if overflow and self.below is not None:  # no free block for them: straight down
            self.below.demote([keys[i] for i in overflow], [srcs[i] for i in overflow])
        blocks = self.allocate(len(new))
        try:
            if not (isinstance(srcs, BlockBatch) and copy_rows(self._rows, [b.block_id for b in blocks], srcs.rows,
                                                               [srcs.row_ids[i] for i in new])):
                for block, i in zip(blocks, new):
                    copy_block(self.block_view(block.block_id), srcs[i])
        except BaseException:
            for block in blocks:  # a failed copy takes no block: back to the queue's head
                block.ref_cnt = 0
                self.free_queue.append(block)
                self.free_queue.move_to_head(block)
            raise
        self.cache_blocks(blocks, [keys[i] for i in new])
        for block in blocks:  # unreferenced, in eviction order
            block.ref_cnt = 0
            self.free_queue.append(block)
        return len(new)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            block = self.cached.get(h)
            if block is not None and block.ref_cnt == 0:
                self.free_queue.move_to_tail(block)

    def deprioritize(self, block_hashes: Sequence[BlockHash]) -> int:
        """Free cached blocks go to the free queue's head (reused first); in use ones stay."""
        self._check_open()
        n = 0
        for h in block_hashes:
            block = self.cached.get(h)
            if block is not None and block.ref_cnt == 0:
                self.free_queue.move_to_head(block)
                n += 1
        return n

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        """Uncache the given blocks: a free one goes to the free queue's head (reused first);
        one in use stays with its requests, uncached (no later lookup finds it), and joins the
        queue as any free block once they free it."""
        self._check_open()
        n = 0
        for h in block_hashes:
            block = self.cached.get(h)
            if block is not None:
                self._uncache(block)
                if block.ref_cnt == 0:
                    self.free_queue.move_to_head(block)
                n += 1
        return n

    def spill(self) -> int:
        """Copy every cached block down through `below` (LRU order first); keep them here too."""
        self._check_open()
        if self.below is None:
            return 0
        order = [b for b in self.free_queue if b.block_hash is not None]
        order += [b for b in self.blocks if b.ref_cnt > 0 and b.block_hash is not None]
        before = self.num_demoted
        self._demote(order)
        return self.num_demoted - before

    def clear(self, *, all_namespaces: bool = False) -> None:
        self._check_open()
        for block in list(self.cached.values()):
            self._uncache(block)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.cached.clear()
            self.kv_cache = torch.empty(0)
            self._rows = self.kv_cache

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("block pool is closed")

    def check_integrity(self) -> None:
        in_queue = set()
        for i, block in enumerate(self.free_queue):
            if i > self.num_blocks:
                raise RuntimeError("block pool: free queue has a cycle (a bug)")
            if block.ref_cnt != 0:
                raise RuntimeError(f"block pool: {block} is in the free queue with references (a bug)")
            in_queue.add(block.block_id)
        if len(in_queue) != len(self.free_queue):
            raise RuntimeError("block pool: free queue length disagrees with its links (a bug)")
        referenced = [b for b in self.blocks if b.ref_cnt > 0]
        if any(b.ref_cnt < 0 for b in self.blocks):
            raise RuntimeError("block pool: negative ref count (a bug)")
        free = [b for b in self.blocks if b.block_id in in_queue and b.block_hash is None]
        cached_free = [b for b in self.blocks if b.block_id in in_queue and b.block_hash is not None]
        if len(free) + len(referenced) + len(cached_free) != self.num_blocks:
            raise RuntimeError(
                f"block pool: {len(free)} free + {len(referenced)} referenced + {len(cached_free)} "
                f"cached-unreferenced != {self.num_blocks} blocks (a bug)"
            )
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise RuntimeError(f"block pool: hash {h.hex()} maps to {block} holding another (a bug)")
        if sum(b.block_hash is not None for b in self.blocks) != len(self.cached):
            raise RuntimeError("block pool: a block holds a hash the cache map lacks (a bug)")

    def occupancy(self) -> Occupancy:
        n = len(self.cached)
        return Occupancy(n, self.num_blocks, n * self._block_bytes, self.num_blocks * self._block_bytes)
