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
    verify_max_error: dict[TierKind, float] = field(default_factory=dict)
    verify_bound: dict[TierKind, float] = field(default_factory=dict)


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
    verify_max_error: Mapping[TierKind, float] = field(default_factory=dict)  # the largest error seen, per tier
    verify_bound: Mapping[TierKind, float] = field(default_factory=dict)  # the largest bound applied, per tier

    @property
    def hit_ratio(self) -> float:
        return self.num_tokens_hit / self.num_tokens_requested if self.num_tokens_requested else 0.0
