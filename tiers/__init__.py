"""Storage tiers behind a `KVCacheStore`: one protocol (`base.py`), one file per tier."""

from tiers.base import Tier, TierStats, TierTraits
from tiers.changes import ChangeKind, TierChange
from tiers.keys import BlockHash, BlockKey, TierKind

__all__ = ["BlockHash", "BlockKey", "ChangeKind", "Tier", "TierChange", "TierKind", "TierStats", "TierTraits"]
