"""Storage tiers behind a `KVCacheStore`: one protocol (`base.py`), one file per tier."""

from tiers.base import BlockKey, Tier, TierKind, TierStats

__all__ = ["BlockKey", "Tier", "TierKind", "TierStats"]
