"""The pieces of `StoreConfig.tiers`: its given sequence parsed into tier configs, the flat
tier fields that stand for one (`FLAT_FIELDS`), and how errors name each tier (`NamedTier`).
`kvstore/config.py` builds a config's tiers from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvstore.errors import ConfigError
from tiers.plugins import shape
from tiers.tier_config import TierConfig, tier_config

# The fields `flat_tiers` reads: with `tiers` given, they keep their defaults.
FLAT_FIELDS = ("pool_blocks", "pool_device", "pool_demotion", "cpu_bytes", "cpu_checksums", "cpu_eviction",
               "demote_admission", "cpu_tenant_quota_bytes", "disk_path", "disk_bytes", "disk_sync",
               "disk_read_bps", "disk_codec", "remote_url", "remote_ttl_s", "remote_timeout_s", "remote_codec")


class NamedTier(NamedTuple):
    """A tier config and how errors name it (`StoreConfig.tiers[2]`, or a flat field)."""

    what: str
    codec_what: str  # how errors name its codec
    config: TierConfig


def parse_given(values: object) -> tuple[TierConfig, ...]:
    """`StoreConfig.tiers` (a sequence of tier configs, registered names or dicts with their
    `type`; None or empty: not given) as tier configs; `ConfigError` naming the bad item."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"StoreConfig.tiers must be a sequence of tier configs, fastest first, got {shape(values)}")
    return tuple(tier_config(v, f"StoreConfig.tiers[{i}]") for i, v in enumerate(values))
