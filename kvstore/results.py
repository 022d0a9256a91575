"""The named results of `KVCacheStore` calls."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tiers.base import TierStats
from tiers.keys import TierKind


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


class ClearResult(NamedTuple):
    """What `clear()` did in the shared remote tier (the local tiers always clear whole).

    Attributes:
        complete: every block it had to delete is gone. False if the remote tier's sweep ran
            out of time or met a fault (counted in the tier's `num_clears_incomplete`, with a
            warning): the blocks left are of an old generation, which no reader of the
            namespace finds, unless the generation itself could not be changed (the server
            did not answer), and they take the server's memory until its LRU, their TTL or
            the next clear.
        num_remote_deleted: keys the remote tier deleted.
    """

    complete: bool
    num_remote_deleted: int


@dataclass
class StoreCounters:
    """The store's own counters since it opened (the tiers keep theirs)."""

    num_store_calls: int = 0
    num_retrieve_calls: int = 0
    num_lookup_calls: int = 0
    num_blocks_stored: int = 0
    num_tokens_requested: int = 0
    num_tokens_hit: int = 0
    num_verified_blocks: int = 0
    verify_mismatches: dict[TierKind, int] = field(default_factory=dict)
    num_prefetch_calls: int = 0
    num_prefetch_dropped: int = 0  # not run: too many prefetches waited
    num_prefetch_promoted: int = 0  # blocks prefetches read from slow tiers into memory
    num_prefetch_failed: int = 0  # blocks planned but not read (gone, damaged), and prefetches a fault ended
    verify_max_error: dict[TierKind, float] = field(default_factory=dict)
    verify_bound: dict[TierKind, float] = field(default_factory=dict)

    def snapshot(self, num_promotion_failures: int, tiers: tuple[TierStats, ...]) -> StoreStats:
        """These counters as `StoreStats`, with the tiers' snapshots (copies: changes nothing)."""
        return StoreStats(self.num_store_calls, self.num_retrieve_calls, self.num_lookup_calls,
                          self.num_blocks_stored, self.num_tokens_requested, self.num_tokens_hit,
                          num_promotion_failures, tiers, self.num_verified_blocks, dict(self.verify_mismatches),
                          self.num_prefetch_calls, self.num_prefetch_dropped, self.num_prefetch_promoted,
                          self.num_prefetch_failed, dict(self.verify_max_error), dict(self.verify_bound))


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
    num_verified_blocks: int = 0  # (block, tier) pairs verify mode compared
    verify_mismatches: Mapping[TierKind, int] = field(default_factory=dict)  # blocks found differing, per tier
    num_prefetch_calls: int = 0
    num_prefetch_dropped: int = 0  # prefetches not run: too many waited (`kvstore/prefetch.py`)
    num_prefetch_promoted: int = 0  # blocks prefetches read from slow tiers into memory
    num_prefetch_failed: int = 0  # blocks prefetches planned but could not read, and prefetches a fault ended
    verify_max_error: Mapping[TierKind, float] = field(default_factory=dict)  # the largest error seen, per tier
    verify_bound: Mapping[TierKind, float] = field(default_factory=dict)  # the largest bound applied, per tier

    @property
    def hit_ratio(self) -> float:
        return self.num_tokens_hit / self.num_tokens_requested if self.num_tokens_requested else 0.0
