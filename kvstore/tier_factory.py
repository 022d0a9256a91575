"""One factory from `StoreConfig` to the ordered tiers, fastest first.

Each tier's config opens it (`TierConfig.open`) with a `TierContext` of what the store's
tiers share. A new tier is one module that registers its config (`tiers/tier_config.py`);
nothing here names a tier, and `known_tiers` lists every registered one.
"""

from __future__ import annotations

from kvstore.codec_config import lossy_kinds
from kvstore.config import StoreConfig
from kvstore.settings import remote_password
from tiers.base import Tier, TierTraits
from tiers.keys import BlockHash, TierKind
from tiers.pool.gpu_pool import BlockPool
from tiers.tier_config import TIERS, TierContext


def known_tiers() -> dict[TierKind, TierTraits]:
    """The kind and traits of every registered tier, kvstrata's fastest first (whether or not
    a config enables it): for labels that must exist before any store does."""
    return {e.config.tier.kind: e.config.tier.traits for e in TIERS.entries()}


def engine_pool(tiers: list[Tier]) -> BlockPool | None:
    """The block pool among `tiers` (the paged KV an engine attends over), if any."""
    top = tiers[0] if tiers else None
    return top if isinstance(top, BlockPool) else None


def tier_context(config: StoreConfig, seed: BlockHash) -> TierContext:
    """What the tiers of a store of `config` share; `seed` is its namespace seed."""
    return TierContext(config.block_shape, config.layout.dtype, seed, identity=config.identity(),
                       verify_tokens=config.verify_tokens, codec_dtype=config.codec_dtype,
                       codec_group=config.codec_group, accepted_codecs=lossy_kinds(config.tier_configs),
                       remote_password=remote_password())


def build_tiers(config: StoreConfig, seed: BlockHash) -> list[Tier]:
    """Open every tier of `config` (`StoreConfig.tier_configs`), fastest first. A failure
    closes the ones already opened and re-raises (a failed open leaks nothing)."""
    ctx = tier_context(config, seed)
    opened: list[Tier] = []
    try:
        for tier in reversed(config.tier_configs):  # the slowest first: the disk refuses bad paths cheaply
            opened.insert(0, tier.open(ctx))
    except BaseException:
        for t in opened:
            t.close()
        raise
    return opened
