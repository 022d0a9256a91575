"""The disk tier's config (`disk`): an LMDB index and slot files in one directory."""

from __future__ import annotations

from dataclasses import dataclass

from tiers.base import Tier
from tiers.codecs import CodecConfig, RawConfig, codec_config
from tiers.disk.durability import DiskSync
from tiers.disk.tier import LMDBTier
from tiers.errors import ConfigError
from tiers.plugins import check_path, require_int
from tiers.tier_config import TierConfig, TierContext, register_tier

_RAW = RawConfig()
MAX_DISK_BYTES = 1 << 44  # 16 TiB: the LMDB map (twice the budget) stays inside the address space


def check_disk_bytes(value: object, what: str) -> int:
    """`value` as a disk budget in bytes (> 0, at most `MAX_DISK_BYTES`); `ConfigError` naming `what`."""
    return require_int(what, value, 1, high=MAX_DISK_BYTES)


@register_tier("disk")
@dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    """`LMDBTier` in directory `path` (shared by every process that names it).

    Attributes:
        capacity_bytes: the budget, payload slots and index together (at least two blocks).
        sync: durability across a power loss, `DiskSync` or its name, or a bool (True:
            "commit", False: "none"); see `tiers/disk/durability.py`.
        read_bps: cap reads at this many bytes per second of payloads as stored (None: none).
        codec: how blocks are written: a codec's label ("none", "zstd", "int8", "fp8",
            "k8v4"), a config, or a dict with its `type`. A lossy one enters the store's
            identity.
    """

    tier = LMDBTier

    path: str
    capacity_bytes: int = 8 << 30
    sync: DiskSync = DiskSync.COMMIT
    read_bps: int | None = None
    codec: CodecConfig = _RAW

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", check_path(self.path, "DiskTierConfig.path"))
        check_disk_bytes(self.capacity_bytes, "DiskTierConfig.capacity_bytes")
        object.__setattr__(self, "sync", DiskSync.parse(self.sync, "DiskTierConfig.sync"))
        if self.read_bps is not None:
            require_int("DiskTierConfig.read_bps", self.read_bps, 1)
        object.__setattr__(self, "codec", codec_config(self.codec, "DiskTierConfig.codec"))

    def check(self, block_bytes: int, what: str) -> None:
        if self.capacity_bytes < 2 * block_bytes:
            raise ConfigError(f"{what}.capacity_bytes={self.capacity_bytes} is below two blocks "
                              f"({2 * block_bytes} bytes)")

    def open(self, ctx: TierContext) -> Tier:
        return LMDBTier(self.path, self.capacity_bytes, ctx.block_shape, ctx.dtype, verify_tokens=ctx.verify_tokens,
                        sync=self.sync, namespace=ctx.namespace, identity=ctx.identity, read_bps=self.read_bps,
                        codec=ctx.codec_spec(self.codec))
