"""Storage tiers behind a `KVCacheStore`: one protocol (`base.py`), one file per tier."""

from tiers.base import BlockHash, BlockKey, Tier, TierKind, TierStats, TierTraits
from tiers.changes import ChangeKind, TierChange

__all__ = ["BlockHash", "BlockKey", "ChangeKind", "Tier", "TierChange", "TierKind", "TierStats", "TierTraits"]
