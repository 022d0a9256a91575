"""The remote tier's config (`remote`): a Valkey/Redis server many hosts share."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiers.base import Tier
from tiers.codecs import CodecConfig, RawConfig, codec_config
from tiers.errors import ConfigError
from tiers.plugins import require_int
from tiers.remote import RemoteTier, check_url
from tiers.tier_config import TierConfig, TierContext, register_tier

_RAW = RawConfig()
MAX_TTL_S = 1 << 32  # a record's expiry, in seconds: what a server takes


def check_timeout(value: object, what: str) -> float:
    """`value` as a bound in seconds, in (0, 60]; `ConfigError` naming `what` otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 60:
        raise ConfigError(f"{what} must be in (0, 60] seconds, got {value!r}")
    return float(value)


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
    """

    tier = RemoteTier

    url: str = field(repr=False)  # it may hold a password
    ttl_s: int | None = None
    timeout_s: float = 0.5
    codec: CodecConfig = _RAW

    def __post_init__(self) -> None:
        check_url(self.url)
        if self.ttl_s is not None:
            require_int("RemoteTierConfig.ttl_s", self.ttl_s, 1, high=MAX_TTL_S)
        check_timeout(self.timeout_s, "RemoteTierConfig.timeout_s")
        object.__setattr__(self, "codec", codec_config(self.codec, "RemoteTierConfig.codec"))

    def open(self, ctx: TierContext) -> Tier:
        return RemoteTier(self.url, ctx.block_shape, ctx.dtype, namespace=ctx.namespace,
                          verify_tokens=ctx.verify_tokens, ttl_s=self.ttl_s, timeout_s=self.timeout_s,
                          codec=ctx.codec_spec(self.codec), password=ctx.remote_password)
