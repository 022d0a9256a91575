"""The Mooncake tier's config (`mooncake`): a Mooncake Store that many hosts pool their KV in.

Importing this module never needs the Mooncake client (the `mooncake` extra): opening the
tier does, and without it is one `ConfigError` naming the extra.
"""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass

from tiers.base import Tier
from tiers.codecs import CodecConfig, RawConfig, codec_config
from tiers.errors import ConfigError
from tiers.mooncake.client import ClientParams
from tiers.mooncake.tier import MooncakeTier
from tiers.plugins import require_int
from tiers.tier_config import TierConfig, TierContext, register_tier

_RAW = RawConfig()
_HOST_PORT = re.compile(r"[A-Za-z0-9_.\-]+:(\d{1,5})|\[[0-9A-Fa-f:]+\]:(\d{1,5})")
_REGION_SLACK = 128 << 10  # a region's room beyond one block: the generation, a record's header and token ids
PROTOCOLS = ("tcp", "rdma")


def _number(value: object, what: str, low: float, high: float) -> float:
    """`value` (an int or float, not a bool) in (low, high] as a float; `ConfigError` naming `what`."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not low < number <= high:
        raise ConfigError(f"{what} must be in ({low:.15g}, {high:.15g}], got {value!r}")
    return float(number)


def _text(value: object, what: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > 1024 \
            or any(c.isspace() for c in value):
        raise ConfigError(f"{what} must be {'a' if empty else 'a non-empty'} string without spaces, got {value!r}")
    return value


def check_master(value: object, what: str = "MooncakeTierConfig.master") -> str:
    """`value` as a master's `host:port`; `ConfigError` naming `what` otherwise."""
    match = _HOST_PORT.fullmatch(value) if isinstance(value, str) else None
    port = int(match.group(1) or match.group(2)) if match else 0
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what} must be the master's host:port (e.g. 127.0.0.1:50051), got {value!r}")
    return str(value)


@register_tier("mooncake")
@dataclass(frozen=True)
class MooncakeTierConfig(TierConfig):
    """`MooncakeTier` on the Mooncake Store whose master is `master` (`host:port`) and whose
    transfer engine finds its peers through `metadata_server` (`http://host:port/metadata`,
    the master's own with `--enable_http_metadata_server=true`, or `etcd://...`,
    `P2PHANDSHAKE`). Every stored block is written to it at once.

    Attributes:
        local_hostname: this host's address as the other hosts reach it (None: its hostname).
        protocol: the transfer engine's, "tcp" or "rdma".
        device_name: the RDMA devices (e.g. "mlx5_0"); "" for tcp.
        segment_bytes: memory this host gives the cluster's pool (0: none, a client only).
        local_buffer_bytes: the client's own transfer buffer.
        buffer_bytes: the transfer buffer kvstrata registers once (two regions: two calls in
            flight); each region must hold a block's record.
        timeout_s, min_rate_bps: a call moving n bytes must end within `timeout_s + n /
            min_rate_bps` seconds, else it is a fault (a miss or a dropped write).
        cooldown_s: after repeated faults of one kind of call (reads, writes), make none of
            that kind for this long, then try again (a failed setup waits as long).
        setup_timeout_s: bound on setting the client up (at open, and after a failure).
        codec: how blocks are written, as `RemoteTierConfig.codec`.
    """

    tier = MooncakeTier

    master: str
    metadata_server: str
    local_hostname: str | None = None
    protocol: str = "tcp"
    device_name: str = ""
    segment_bytes: int = 1 << 30
    local_buffer_bytes: int = 16 << 20
    buffer_bytes: int = 256 << 20
    timeout_s: float = 1.0
    min_rate_bps: float = 64 << 20
    cooldown_s: float = 5.0
    setup_timeout_s: float = 10.0
    codec: CodecConfig = _RAW

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        check_master(self.master)
        _text(self.metadata_server, "MooncakeTierConfig.metadata_server")
        if self.local_hostname is not None:
            _text(self.local_hostname, "MooncakeTierConfig.local_hostname")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"MooncakeTierConfig.protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        _text(self.device_name, "MooncakeTierConfig.device_name", empty=True)
        require_int("MooncakeTierConfig.segment_bytes", self.segment_bytes, 0, high=1 << 50)
        require_int("MooncakeTierConfig.local_buffer_bytes", self.local_buffer_bytes, 1 << 20, high=1 << 40)
        require_int("MooncakeTierConfig.buffer_bytes", self.buffer_bytes, 2 * _REGION_SLACK, high=1 << 40)
        set_(self, "timeout_s", _number(self.timeout_s, "MooncakeTierConfig.timeout_s", 0, 60))
        set_(self, "min_rate_bps", _number(self.min_rate_bps, "MooncakeTierConfig.min_rate_bps", 1023, 1 << 40))
        set_(self, "cooldown_s", _number(self.cooldown_s, "MooncakeTierConfig.cooldown_s", 0, 3600))
        set_(self, "setup_timeout_s", _number(self.setup_timeout_s, "MooncakeTierConfig.setup_timeout_s", 0, 600))
        set_(self, "codec", codec_config(self.codec, "MooncakeTierConfig.codec"))

    def check(self, block_bytes: int, what: str) -> None:
        """Each region of the transfer buffer must hold one block's record."""
        if self.buffer_bytes // 2 < block_bytes + _REGION_SLACK:
            raise ConfigError(f"{what}.buffer_bytes ({self.buffer_bytes}) must hold two blocks of {block_bytes} "
                              f"bytes and {_REGION_SLACK} bytes each beside: at least "
                              f"{2 * (block_bytes + _REGION_SLACK)}")

    def open(self, ctx: TierContext) -> Tier:
        self.check(ctx.block_bytes, "MooncakeTierConfig")
        params = ClientParams(self.local_hostname or socket.gethostname(), self.metadata_server, self.segment_bytes,
                              self.local_buffer_bytes, self.protocol, self.device_name, self.master)
        return MooncakeTier(params, ctx.block_shape, ctx.dtype, namespace=ctx.namespace,
                            verify_tokens=ctx.verify_tokens, timeout_s=self.timeout_s, min_rate_bps=self.min_rate_bps,
                            cooldown_s=self.cooldown_s, setup_timeout_s=self.setup_timeout_s,
                            buffer_bytes=self.buffer_bytes, codec=ctx.codec_spec(self.codec))
