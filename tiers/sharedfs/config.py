"""The shared-filesystem tier's config (`sharedfs`): a directory many hosts mount."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiers.base import Tier
from tiers.codecs import CodecConfig, RawConfig, codec_config
from tiers.errors import ConfigError
from tiers.plugins import check_path, require_int
from tiers.sharedfs.tier import SharedFSTier
from tiers.tier_config import TierConfig, TierContext, register_tier

_RAW = RawConfig()
MAX_BYTES = 1 << 50  # 1 PiB


def _seconds(config: object, name: str, high: float, *, zero: bool = False) -> None:
    """Set `config.name` to its value as a float in (0, high] seconds ([0, high] with `zero`);
    `ConfigError` naming it otherwise."""
    value = getattr(config, name)
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
    if not ((number >= 0) if zero else (number > 0)) or not number <= high:
        raise ConfigError(f"SharedFSTierConfig.{name} must be in {'[' if zero else '('}0, {high:g}] seconds, "
                          f"got {value!r}")
    object.__setattr__(config, name, float(value))


@register_tier("sharedfs")
@dataclass(frozen=True)
class SharedFSTierConfig(TierConfig):
    """`SharedFSTier` in directory `path`, which every host of a fleet mounts (NFS, Lustre,
    CephFS, 3FS, a Kubernetes RWX volume). Every stored block is written to it.

    Attributes:
        capacity_bytes: the directory's budget, every namespace's files together (give every
            host the same); eviction removes the least recently used files past it.
        codec: how blocks are written, as `DiskTierConfig.codec`.
        io_threads: the tier's own threads: the files of one call read and written in parallel.
        timeout_s: the longest a call waits for them (a hung mount: a miss, not a hang).
        cooldown_s: after a call ran out of time, make none for this long.
        touch_after_s: a read hit marks its file used (`utime`) if it is this old (recency for
            eviction, at most one metadata write per file per this many seconds).
        orphan_after_s: temporary files of writers (killed mid-write) this old are removed.
        scan_interval_s: each host rescans the directory's bytes this often ...
        scan_max_entries: ... visiting at most this many files per round.
        clear_budget_s: a clear (or a listing) walks the directory for at most this long.
        share_id: what names the directory to routers (default its real path here): give
            hosts that mount it at different paths the same one.
    """

    tier = SharedFSTier

    path: str
    capacity_bytes: int = 64 << 30
    codec: CodecConfig = _RAW
    io_threads: int = 8
    timeout_s: float = 30.0
    cooldown_s: float = 5.0
    touch_after_s: float = 60.0
    orphan_after_s: float = 600.0
    scan_interval_s: float = 10.0
    scan_max_entries: int = 100_000
    clear_budget_s: float = 30.0
    share_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", check_path(self.path, "SharedFSTierConfig.path"))
        require_int("SharedFSTierConfig.capacity_bytes", self.capacity_bytes, 1, high=MAX_BYTES)
        object.__setattr__(self, "codec", codec_config(self.codec, "SharedFSTierConfig.codec"))
        require_int("SharedFSTierConfig.io_threads", self.io_threads, 1, high=256)
        _seconds(self, "timeout_s", 3600)
        _seconds(self, "cooldown_s", 3600, zero=True)
        _seconds(self, "touch_after_s", 86400, zero=True)
        _seconds(self, "orphan_after_s", 30 * 86400)
        _seconds(self, "scan_interval_s", 86400, zero=True)
        require_int("SharedFSTierConfig.scan_max_entries", self.scan_max_entries, 1)
        _seconds(self, "clear_budget_s", 86400)
        if self.share_id is not None and (not isinstance(self.share_id, str) or not self.share_id
                                          or not self.share_id.isprintable()):
            raise ConfigError(f"SharedFSTierConfig.share_id must be a non-empty printable string, "
                              f"got {self.share_id!r}")

    def check(self, block_bytes: int, what: str) -> None:
        if self.capacity_bytes < 2 * block_bytes:
            raise ConfigError(f"{what}.capacity_bytes={self.capacity_bytes} is below two blocks "
                              f"({2 * block_bytes} bytes)")

    def open(self, ctx: TierContext) -> Tier:
        try:
            tier = SharedFSTier(self.path, self.capacity_bytes, ctx.block_shape, ctx.dtype, namespace=ctx.namespace,
                                verify_tokens=ctx.verify_tokens, codec=ctx.codec_spec(self.codec),
                                io_threads=self.io_threads, timeout_s=self.timeout_s, cooldown_s=self.cooldown_s,
                                touch_after_s=self.touch_after_s, orphan_after_s=self.orphan_after_s,
                                scan_interval_s=self.scan_interval_s, scan_max_entries=self.scan_max_entries,
                                clear_budget_s=self.clear_budget_s, share_id=self.share_id)
        except OSError as exc:
            raise ConfigError(f"SharedFSTierConfig.path={self.path!r} cannot be used: {exc}") from None
        if not os.access(tier.ns_dir, os.W_OK | os.X_OK):
            tier.close()
            raise ConfigError(f"SharedFSTierConfig.path={self.path!r} is not writable")
        return tier
