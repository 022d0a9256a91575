"""The tiers of a `StoreConfig`, fastest first: its `tiers` as given, or the sequence its flat
tier fields (`cpu_bytes`, `disk_path`, ...) stand for; checked against its layout.

The flat fields are sugar: each enables one built-in tier (`pool_blocks` > 0 the pool,
`cpu_bytes` > 0 the CPU tier, `disk_path` the disk, `remote_url` the remote), in that order,
and a store built from them is the store built from the tier configs `flat_tiers` returns.
Their errors name the flat fields, as before the tier configs existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvstore.codec_config import check_tier_codecs
from kvstore.errors import ConfigError
from tiers.codecs import CodecConfig, codec_config, parse_codec
from tiers.cpu.config import CPUTierConfig, check_fits
from tiers.disk.config import DiskTierConfig, check_disk_bytes, check_path
from tiers.disk.durability import DiskSync
from tiers.plugins import require_int, shape
from tiers.policies.admission import AdmissionKind, parse_admission
from tiers.policies.eviction import eviction_config, parse_eviction
from tiers.pool.config import PoolTierConfig, check_device, parse_demotion
from tiers.remote.config import MAX_TTL_S, RemoteTierConfig, check_timeout
from tiers.remote.url import check_url
from tiers.tier_config import TierConfig, tier_config

if TYPE_CHECKING:
    from kvstore.config import StoreConfig

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


def flat_values(c: StoreConfig) -> dict[str, object]:
    """The flat tier fields of `c`, checked (`ConfigError` naming the field) and normalized
    (enums, parsed rules), to be set on it."""
    require_int("StoreConfig.cpu_bytes", c.cpu_bytes, 0)
    check_disk_bytes(c.disk_bytes, "StoreConfig.disk_bytes")
    require_int("StoreConfig.pool_blocks", c.pool_blocks, 0)
    if c.pool_device is not None:
        check_device(c.pool_device, "StoreConfig.pool_device")
    out: dict[str, object] = {
        "pool_demotion": parse_demotion(c.pool_demotion, "StoreConfig.pool_demotion"),
        "disk_sync": DiskSync.parse(c.disk_sync, "StoreConfig.disk_sync"),
        "cpu_eviction": parse_eviction(c.cpu_eviction, "StoreConfig.cpu_eviction"),
    }
    if c.disk_path is not None:
        out["disk_path"] = check_path(c.disk_path, "StoreConfig.disk_path")
        if c.disk_bytes < 2 * c.block_bytes:
            raise ConfigError(f"StoreConfig.disk_bytes={c.disk_bytes} is below two blocks ({2 * c.block_bytes} bytes)")
    if 0 < c.cpu_bytes < c.block_bytes:
        raise ConfigError(f"StoreConfig.cpu_bytes={c.cpu_bytes} holds no block of {c.block_bytes} bytes; "
                          "use 0 to disable the CPU tier")
    if c.remote_url is not None:
        check_url(c.remote_url)
    if c.remote_ttl_s is not None:
        require_int("StoreConfig.remote_ttl_s", c.remote_ttl_s, 1, high=MAX_TTL_S)
    check_timeout(c.remote_timeout_s, "StoreConfig.remote_timeout_s")
    admission = parse_admission(c.demote_admission, "StoreConfig.demote_admission")
    if admission.kind is AdmissionKind.TINYLFU:
        raise ConfigError("StoreConfig.demote_admission must be 'all' or 'seen:N'; 'tinylfu' compares with "
                          "the lower tier's victim, which the CPU tier does not know")
    out["demote_admission"] = admission
    if c.cpu_tenant_quota_bytes is not None:
        quota = require_int("StoreConfig.cpu_tenant_quota_bytes", c.cpu_tenant_quota_bytes, 1)
        check_fits("StoreConfig.cpu_tenant_quota_bytes", quota, c.block_bytes)
    if c.disk_read_bps is not None:
        require_int("StoreConfig.disk_read_bps", c.disk_read_bps, 1)
    for name in ("disk_codec", "remote_codec"):
        out[name] = parse_codec(getattr(c, name), f"StoreConfig.{name}")
    return out


def flat_tiers(c: StoreConfig) -> list[NamedTier]:
    """The tiers `c`'s flat fields (checked by `flat_values`) enable, fastest first."""
    named: list[NamedTier] = []
    if c.pool_blocks:
        named.append(NamedTier("StoreConfig.pool_blocks", "", PoolTierConfig(
            c.pool_blocks, None if c.pool_device is None else str(c.pool_device), c.pool_demotion)))
    if c.cpu_bytes:
        named.append(NamedTier("StoreConfig.cpu_bytes", "", CPUTierConfig(
            c.cpu_bytes, c.cpu_checksums, eviction_config(c.cpu_eviction), c.demote_admission,
            c.cpu_tenant_quota_bytes)))
    if c.disk_path is not None:
        named.append(NamedTier("StoreConfig.disk_path", "StoreConfig.disk_codec", DiskTierConfig(
            str(c.disk_path), c.disk_bytes, DiskSync.parse(c.disk_sync), c.disk_read_bps, codec_config(c.disk_codec))))
    if c.remote_url is not None:
        named.append(NamedTier("StoreConfig.remote_url", "StoreConfig.remote_codec", RemoteTierConfig(
            c.remote_url, c.remote_ttl_s, c.remote_timeout_s, codec_config(c.remote_codec))))
    return named


def store_tiers(c: StoreConfig) -> tuple[TierConfig, ...]:
    """The tiers `c` opens, fastest first (see the module docstring). Raises `ConfigError`
    for flat tier fields set beside `tiers`, no tier, an engine's pool below another tier,
    two tiers of one kind, a tier too small for a block, or a codec that cannot encode the
    layout (each naming the tier or field)."""
    if c.tiers:
        defaults = {f.name: f.default for f in dataclasses.fields(c)}
        set_ = [name for name in FLAT_FIELDS if getattr(c, name) != defaults[name]]
        if set_:
            raise ConfigError(f"StoreConfig.tiers is given, and so are the flat tier fields {set_}: give one or "
                              "the other (the flat fields build the tiers only when `tiers` is empty)")
        named = [NamedTier(f"StoreConfig.tiers[{i}]", f"StoreConfig.tiers[{i}].codec", t)
                 for i, t in enumerate(parse_given(c.tiers))]  # parsed already: the configs pass through
    else:
        named = flat_tiers(c)
    if not named:
        raise ConfigError("StoreConfig enables no tier: set pool_blocks, cpu_bytes, disk_path or remote_url, "
                          "or give tiers")
    kinds: dict[str, str] = {}
    for i, t in enumerate(named):
        tier = t.config.tier
        if tier.traits.engine_memory and i:
            raise ConfigError(f"{t.what}: a {tier.kind.value!r} tier holds the engine's paged KV; it must be "
                              "the first tier")
        if tier.kind in kinds:
            raise ConfigError(f"{t.what}: a second {tier.kind.value!r} tier (the first is {kinds[tier.kind]})")
        kinds[tier.kind] = t.what
        t.config.check(c.block_bytes, t.what)
        if t.config.codec is not None and not isinstance(t.config.codec, CodecConfig):
            raise ConfigError(f"{t.codec_what or t.what + '.codec'} must be a codec config (a tier config turns "
                              f"what it is given into one with tiers.codecs.codec_config), got {t.config.codec!r}")
    check_tier_codecs([(t.codec_what or f"{t.what}.codec", t.config.codec) for t in named], c.block_shape,
                      c.layout.dtype, c.codec_dtype, c.codec_group)
    return tuple(t.config for t in named)
