"""The remote tier's config (`remote`): a Valkey/Redis server many hosts share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tiers.base import Tier
from tiers.codecs import CodecConfig, RawConfig, codec_config
from tiers.errors import ConfigError
from tiers.plugins import require_int
from tiers.remote.client import CONNECTIONS_PER_NODE
from tiers.remote.tier import RemoteTier, check_url
from tiers.tier_config import TierConfig, TierContext, register_tier

_RAW = RawConfig()
MAX_TTL_S = 1 << 32  # a record's expiry, in seconds: what a server takes
MAX_PENDING_BYTES = 256 << 20  # queued writes, by default
MAX_CONNECTIONS_PER_NODE = 64
MIN_RATE_BPS = 64 << 20  # the slowest transfer a call may make before it is a fault, by default


def check_number(value: object, what: str, low: float, high: float, unit: str, *, above_low: bool = True) -> float:
    """`value` (an int or a float, never a bool) in (low, high] (`above_low` False: [low,
    high]) as a float; `ConfigError` naming `what` otherwise (NaN and infinities included)."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not ((low < number) if above_low else (low <= number)) or not number <= high:
        raise ConfigError(f"{what} must be in {'(' if above_low else '['}{low:.15g}, {high:.15g}] {unit}, "
                          f"got {value!r}")
    return float(number)


def check_timeout(value: object, what: str) -> float:
    """`value` as a bound in seconds, in (0, 60]; `ConfigError` naming `what` otherwise."""
    return check_number(value, what, 0, 60, "seconds")


@register_tier("remote")
@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """`RemoteTier` on the server `url`: `redis://[user:password@]host:port[/db]`,
    `rediss://` (TLS), `unix:///path.sock` or `redis+cluster://host:port[,host:port...]`;
    without a password in the URL, the store's (`KVSTRATA_REMOTE_PASSWORD`). Every stored
    block is written to it in the background.

    Attributes:
        ttl_s: expire records after this many seconds (None: the server's LRU).
        timeout_s: bound on every call; a slower server is a miss.
        codec: how blocks are written, as `DiskTierConfig.codec`.
        max_pending_bytes: writes queued for the server at most; a store that finds the
            queue full waits for room (a record larger than this waits alone).
        cooldown_s: after repeated faults of one kind of call (reads, writes), make none of
            that kind for this long, then try again.
        min_rate_bps: a call moving n bytes must end within `timeout_s + n / min_rate_bps`
            seconds (in [1 KiB/s, 1 TiB/s]), else it is a fault.
        clear_budget_s: a clear (or a listing) of this namespace on the server walks it for
            at most this long; what it could not reach is left to the next one.
        connections_per_node: reads and writes of at least 4 MiB run on this many connections
            per server node at once (in [1, 64]; each key always on the same one), with this many
            threads less one per tier; 1: one connection, the caller's thread.
    """

    tier = RemoteTier

    url: str = field(repr=False)  # it may hold a password
    ttl_s: int | None = None
    timeout_s: float = 0.5
    codec: CodecConfig = _RAW
    max_pending_bytes: int = MAX_PENDING_BYTES
    cooldown_s: float = 5.0
    min_rate_bps: float = MIN_RATE_BPS
    clear_budget_s: float = 30.0
    connections_per_node: int = CONNECTIONS_PER_NODE

    def __post_init__(self) -> None:
        check_url(self.url)
        if self.ttl_s is not None:
            require_int("RemoteTierConfig.ttl_s", self.ttl_s, 1, high=MAX_TTL_S)
        set_ = object.__setattr__
        set_(self, "timeout_s", check_timeout(self.timeout_s, "RemoteTierConfig.timeout_s"))
        set_(self, "codec", codec_config(self.codec, "RemoteTierConfig.codec"))
        require_int("RemoteTierConfig.max_pending_bytes", self.max_pending_bytes, 1)
        set_(self, "cooldown_s", check_number(self.cooldown_s, "RemoteTierConfig.cooldown_s", 0, 3600, "seconds"))
        set_(self, "min_rate_bps", check_number(self.min_rate_bps, "RemoteTierConfig.min_rate_bps", 1 << 10, 1 << 40,
                                                "bytes per second", above_low=False))
        set_(self, "clear_budget_s", check_number(self.clear_budget_s, "RemoteTierConfig.clear_budget_s", 0, 86400,
                                                  "seconds"))
        require_int("RemoteTierConfig.connections_per_node", self.connections_per_node, 1,
                    high=MAX_CONNECTIONS_PER_NODE)

    def open(self, ctx: TierContext) -> Tier:
        return RemoteTier(self.url, ctx.block_shape, ctx.dtype, namespace=ctx.namespace,
                          verify_tokens=ctx.verify_tokens, ttl_s=self.ttl_s, timeout_s=self.timeout_s,
                          max_pending_bytes=self.max_pending_bytes, cooldown_s=self.cooldown_s,
                          min_rate_bps=self.min_rate_bps, codec=ctx.codec_spec(self.codec),
                          password=ctx.remote_password, clear_budget_s=self.clear_budget_s,
                          connections_per_node=self.connections_per_node)
