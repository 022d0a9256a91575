"""Storage tiers behind a `KVCacheStore`: one protocol (`base.py`), one file per tier."""

from tiers.base import BlockHash, BlockKey, Tier, TierKind, TierStats, TierTraits

__all__ = ["BlockHash", "BlockKey", "Tier", "TierKind", "TierStats", "TierTraits"]
