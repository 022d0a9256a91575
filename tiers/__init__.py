"""Storage tiers behind a `KVCacheStore`: one protocol (`base.py`), one file per tier."""

import kvstore  # noqa: F401  first: kvstore.store imports tiers.base (`import tiers.cpu` alone failed)
from tiers.base import BlockKey, Tier, TierKind, TierStats

__all__ = ["BlockKey", "Tier", "TierKind", "TierStats"]
