"""One factory from `StoreConfig` to the ordered tiers, fastest first.

A new tier is one file under `tiers/` plus one entry in `_BUILDERS`: its class (whose `kind`
and `traits` say what it is, see `known_tiers`) and a function that opens it from the config,
or returns None when the config does not enable it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.settings import remote_password
from tiers.base import BlockHash, Tier, TierKind, TierTraits
from tiers.codecs import CodecKind, CodecSpec, parse_codec
from tiers.cpu import CPUTier
from tiers.gpu_pool import BlockPool
from tiers.lmdb import LMDBTier
from tiers.remote import RemoteTier


def _pool(config: StoreConfig, seed: BlockHash) -> Tier | None:
    if not config.pool_blocks:
        return None
    try:
        return BlockPool(config.pool_blocks, config.block_shape, config.layout.dtype, device=config.pool_device,
                         verify_tokens=config.verify_tokens, demotion=config.pool_demotion)
    except (RuntimeError, AssertionError, ValueError) as exc:  # no such device, no memory
        raise ConfigError(
            f"StoreConfig.pool_blocks={config.pool_blocks} on pool_device={config.pool_device!r} "
            f"cannot be allocated: {exc}"
        ) from None


def _cpu(config: StoreConfig, seed: BlockHash) -> Tier | None:
    if not config.cpu_bytes:
        return None
    quota = config.cpu_tenant_quota_bytes
    return CPUTier(config.cpu_blocks, config.block_shape, config.layout.dtype, verify_tokens=config.verify_tokens,
                   checksum=config.cpu_checksums, eviction=config.cpu_eviction,
                   demote_admission=config.demote_admission,
                   tenant_quota_blocks=None if quota is None else quota // config.block_bytes)


def _codec(config: StoreConfig, kind: CodecKind) -> CodecSpec:
    """A tier's codecs: it writes with `kind` and reads every lossy codec the config's
    identity admits (`StoreConfig.lossy_codecs`)."""
    accepted = frozenset(parse_codec(name) for name in config.lossy_codecs)
    return CodecSpec(kind, config.codec_dtype, config.codec_group, accepted)


def _disk(config: StoreConfig, seed: BlockHash) -> Tier | None:
    if config.disk_path is None:
        return None
    return LMDBTier(str(config.disk_path), config.disk_bytes, config.block_shape, config.layout.dtype,
                    verify_tokens=config.verify_tokens, sync=config.disk_sync, namespace=seed,
                    identity=config.identity(), read_bps=config.disk_read_bps,
                    codec=_codec(config, config.disk_codec))


def _remote(config: StoreConfig, seed: BlockHash) -> Tier | None:
    if config.remote_url is None:
        return None
    return RemoteTier(config.remote_url, config.block_shape, config.layout.dtype, namespace=seed,
                      verify_tokens=config.verify_tokens, ttl_s=config.remote_ttl_s, timeout_s=config.remote_timeout_s,
                      codec=_codec(config, config.remote_codec), password=remote_password())


class _Builder(NamedTuple):
    tier: type[Tier]  # the class it opens
    build: Callable[[StoreConfig, BlockHash], Tier | None]


# Fastest first. The order is the tier stack's: demotion goes down it, promotion up.
_BUILDERS: tuple[_Builder, ...] = (
    _Builder(BlockPool, _pool), _Builder(CPUTier, _cpu), _Builder(LMDBTier, _disk), _Builder(RemoteTier, _remote))


def known_tiers() -> dict[TierKind, TierTraits]:
    """The kind and traits of every tier this factory can open, fastest first (whether or not
    a config enables it): for labels that must exist before any store does."""
    return {b.tier.kind: b.tier.traits for b in _BUILDERS}


def engine_pool(tiers: list[Tier]) -> BlockPool | None:
    """The block pool among `tiers` (the paged KV an engine attends over), if any."""
    top = tiers[0] if tiers else None
    return top if isinstance(top, BlockPool) else None


def build_tiers(config: StoreConfig, seed: BlockHash) -> list[Tier]:
    """Open every tier `config` enables, fastest first. A failure closes the ones already
    opened and re-raises (a failed open leaks nothing)."""
    opened: list[Tier] = []
    try:
        for builder in reversed(_BUILDERS):  # the slowest first: the disk refuses bad paths cheaply
            tier = builder.build(config, seed)
            if tier is not None:
                opened.insert(0, tier)
    except BaseException:
        for tier in opened:
            tier.close()
        raise
    return opened
