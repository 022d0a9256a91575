"""The block pool's config (`pool`): the paged KV an engine attends over, tier 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiers.base import Tier
from tiers.errors import ConfigError
from tiers.plugins import require_int
from tiers.pool.gpu_pool import BlockPool, DemotionPolicy
from tiers.tier_config import TierConfig, TierContext, register_tier


def check_device(value: object, what: str) -> None:
    """Raise `ConfigError` naming `what` unless `value` (a str or `torch.device`) names a
    device that can hold data; whether it is present is known only when the pool opens."""
    try:
        if not isinstance(value, (str, torch.device)):
            raise TypeError(f"a str or torch.device, not {type(value).__name__}")
        if torch.device(value).type == "meta":
            raise ValueError("meta tensors hold no data")
    except (RuntimeError, TypeError, ValueError) as exc:
        why = " ".join(str(exc).split())[:200]  # torch's text quotes the value raw: no control characters
        raise ConfigError(f"{what}={value!r} is not a device: {why}") from None


def parse_demotion(value: object, what: str) -> DemotionPolicy:
    """`value` (a `DemotionPolicy` or its name) as a `DemotionPolicy`; `ConfigError` naming `what`."""
    try:
        return DemotionPolicy(value)
    except ValueError:
        raise ConfigError(f"{what} must be 'on_evict' or 'write_through', got {value!r}") from None


@register_tier("pool")
@dataclass(frozen=True)
class PoolTierConfig(TierConfig):
    """`BlockPool`: `num_blocks` blocks on `device` (default: CUDA when present, else the
    CPU); `demotion` is "on_evict" (a block is copied down when reused) or "write_through"
    (when cached). A pool larger than the device's memory, or a device that is absent, raises
    `ConfigError` when the store opens. It must be the first tier."""

    tier = BlockPool

    num_blocks: int
    device: str | None = None
    demotion: DemotionPolicy = DemotionPolicy.ON_EVICT

    def __post_init__(self) -> None:
        require_int("PoolTierConfig.num_blocks", self.num_blocks, 1)
        if self.device is not None:
            check_device(self.device, "PoolTierConfig.device")
        object.__setattr__(self, "demotion", parse_demotion(self.demotion, "PoolTierConfig.demotion"))

    def open(self, ctx: TierContext) -> Tier:
        try:
            return BlockPool(self.num_blocks, ctx.block_shape, ctx.dtype, device=self.device,
                             verify_tokens=ctx.verify_tokens, demotion=self.demotion)
        except (RuntimeError, AssertionError, ValueError) as exc:  # no such device, no memory
            raise ConfigError(f"a pool of {self.num_blocks} blocks on device {self.device!r} cannot be allocated: "
                              f"{exc}") from None
