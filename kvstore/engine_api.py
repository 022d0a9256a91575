"""The engine API: one narrow, block-keyed protocol every engine reaches the store through.

In the spirit of vLLM's `OffloadingManager` and LMCache's L2 adapters: five calls, each
keyed by `BlockKey`s in prefix order (a block's key stands for the block with its whole
prefix, so "the longest held prefix" is well defined). Keys come from one of two places:

- the store's own chain, `KVCacheStore.keys(tokens, ...)`: the chained hash of the tokens in
  the store's namespace, with the token ids (verified on every hit) and what KV events need;
- the engine, `KVCacheStore.engine_keys(ids, tokens=None)`: ids the engine names its blocks
  by (SGLang's page hashes, vLLM's block hashes), each hashed with the store's namespace
  seed (`hashing.engine_block_hash`), so two models never share an entry under one id; token
  ids are optional and, when given, verified on every hit (other tokens: a miss).

A key made by another store is a miss here, never another model's KV. Keys built by hand
skip the namespace: engines take them from those two calls only. The store's token API
(`store`, `retrieve`, `lookup`, `prefetch`) is these calls after hashing the tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple, Protocol

import torch

from kvstore.prefetch import PrefetchResult
from kvstore.priority import PriorityResult
from kvstore.retention import RetainResult
from kvstore.verify import VerifyResult
from tiers.keys import BlockHash, BlockKey, TierKind

# One block-shaped tensor per key, or a function that, given how many leading blocks are
# held, returns that many (so a caller allocates only what a load will fill).
Destinations = Sequence[torch.Tensor] | Callable[[int], Sequence[torch.Tensor]]


class LookupResult(NamedTuple):
    """The longest prefix of the keys some tier holds: `tiers[i]` is the fastest tier
    holding block i (where a load would read it from)."""

    tiers: list[TierKind]

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def blocks_per_tier(self) -> dict[TierKind, int]:
        counts: dict[TierKind, int] = {}
        for kind in self.tiers:
            counts[kind] = counts.get(kind, 0) + 1
        return counts


class LoadResult(NamedTuple):
    """What `load` copied: the `num_blocks` leading blocks, and how many each tier served."""

    num_blocks: int
    blocks_per_tier: dict[TierKind, int]


class SaveResult(NamedTuple):
    """What `save` did: `num_new` blocks written that no tier above held, and `num_held`
    leading blocks of the keys held once it returned."""

    num_new: int
    num_held: int


class BlockChange(enum.Enum):
    """What happened to the blocks of a `BlockEvent`."""

    STORED = "stored"  # entered the tier
    REMOVED = "removed"  # left it (evicted, demoted, deleted as damaged)
    CLEARED = "cleared"  # the tier lost every block of this store (`block_hashes` is empty)


class BlockEvent(NamedTuple):
    """One change of one tier, its blocks named by their store keys (`BlockKey.block_hash`:
    for an engine's own ids, `engine_keys(ids)[i].block_hash`)."""

    change: BlockChange
    tier: TierKind
    block_hashes: tuple[BlockHash, ...]


class EventBatch(NamedTuple):
    """The changes since the last `take_events`, oldest first, and how many blocks' changes
    were dropped because the buffer was full (then the engine's view must be rebuilt)."""

    events: list[BlockEvent]
    num_dropped: int


class BlockStore(Protocol):
    """The engine API (see the module docstring). Thread-safe; every call raises
    `StoreClosedError` once the store is closing, and `InvalidInputError` (changing
    nothing) for keys that are not a sequence of `BlockKey`s or tensors that do not fit.
    """

    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        """The longest prefix of `keys` some tier holds, and where each block of it lies.
        Moves no data, pins nothing, changes no recency; no keys: an empty result. A block
        found damaged by a later `load` can make that load return less."""
        ...

    def load(self, keys: Sequence[BlockKey], destinations: Destinations) -> LoadResult:
        """Copy the longest held prefix of `keys` into `destinations` (block i into the i-th),
        each block from the fastest tier holding it, one read per run of one tier.

        Stops at the first block missing or failing validation (which its tier deletes):
        no destination past it is counted, so a load never leaves a hole (their bytes are
        undefined: a shared tier receives a block in place before checking it). Lower-tier
        hits are then promoted into the top tier, and the prefix made most recently used.
        Destinations are block-shaped tensors (`StoreConfig.block_shape`, the layout's dtype,
        any device, pairwise disjoint), one per key; or a function given the number of
        leading blocks held (> 0; not called on a miss) returning that many, called once
        with the store's lock held (it must not wait for another thread's store call).
        """
        ...

    def save(self, keys: Sequence[BlockKey], sources: Sequence[torch.Tensor], *,
             generation: int | None = None) -> SaveResult:
        """Write block `sources[i]` under `keys[i]` (one source per key, block-shaped, the
        layout's dtype, any device) into the top tier, tail first (a sequence's tail is
        evicted before its prefix), and at once into shared and write-through tiers; blocks
        already held are only touched. The blocks before `keys[0]` need not be held. With a
        `generation` (`KVCacheStore.generation` when the KV was produced) older than the
        store's, a `clear()` ran since: writes nothing. `DiskFullError` if the tiers cannot
        make room (reads keep working)."""
        ...

    def prefetch(self, keys: Sequence[BlockKey], *, max_blocks: int | None = None) -> Future[PrefetchResult]:
        """In the background, bring the longest held prefix of `keys` (its first `max_blocks`
        at most; default `MAX_PREFETCH_BLOCKS`) from tiers outside memory (disk, remote)
        into the slowest memory tier, never evicting retained blocks nor the prefix's own.
        The future resolves to a `PrefetchResult`, never an exception (a fault is a counted
        miss); `DROPPED` at once if too many prefetches wait; `CLOSED` if `close()` found it
        queued or running (never cancelled). The slow reads run without the store's lock;
        nothing is inserted if a `clear()` ran meanwhile (`kvstore/prefetch.py`)."""
        ...

    def retain(self, keys: Sequence[BlockKey], seconds: float) -> RetainResult:
        """Keep the blocks of `keys` held in the memory tier below the engine through eviction
        pressure for `seconds` (a hint that they will come back), within the tenant's budget
        (`StoreConfig.retain_share`); what does not fit or is not there is reported clipped
        (`kvstore/retention.py`). Retaining again extends the deadline."""
        ...

    def prioritize(self, keys: Sequence[BlockKey], priority: str) -> PriorityResult:
        """Give the blocks of `keys` an eviction priority, "low", "normal" or "high"
        (`kvstore/priority.py`): low ones are the next victims in the tiers that order their
        own eviction; high ones are kept in the memory tier below the engine within the
        tenant's `retain_share`, the rest reported clipped. A bad priority is one
        `InvalidInputError` naming it, and changes nothing."""
        ...

    def verify(self, keys: Sequence[BlockKey], computed: Sequence[torch.Tensor], *,
               tolerance: float = 0.0) -> VerifyResult:
        """Compare KV the engine just computed (`computed[i]` for `keys[i]`, block-shaped)
        with what every tier holding each key keeps: byte for byte in a store of exact
        codecs, else within the lossy codecs' error bound, plus `tolerance` (in [0, 1]) times
        each block's largest magnitude per element. A block beyond it in any tier is removed
        from every tier (KV events withdraw it) and counted per tier
        (`StoreStats.verify_mismatches`, with the largest error seen and bound applied).
        Writes nothing else (`kvstore/verify.py`)."""
        ...

    def take_events(self) -> EventBatch:
        """The block changes of every tier since the last call, oldest first, and drains
        them. Recording starts with the first call (a store nobody drains pays nothing), so
        an engine calls it once when it starts; the buffer is bounded (`EventBatch`)."""
        ...
