"""The CPU tier's config (`cpu`): a slab of host memory, its eviction policy and admission."""

from __future__ import annotations

from dataclasses import dataclass

from tiers.base import Tier
from tiers.cpu.tier import CPUTier
from tiers.errors import ConfigError
from tiers.plugins import require_int
from tiers.policies.admission import ADMIT_ALL, AdmissionRule, admission_rule
from tiers.policies.eviction import EvictionConfig, LRUConfig, eviction_config
from tiers.tier_config import TierConfig, TierContext, register_tier

_LRU = LRUConfig()


def demote_rule(value: object, what: str) -> AdmissionRule:
    """`value` as the rule of the blocks the CPU tier demotes; `ConfigError` naming `what`
    for a bad one or one that needs the lower tier's victim (unknown to the CPU tier)."""
    rule = admission_rule(value, what)
    if rule.needs_victim:
        raise ConfigError(f"{what} must be 'all' or 'seen:N'; {str(rule)!r} compares with the lower tier's victim, "
                          "which the CPU tier does not know")
    return rule


def check_fits(what: str, value: int, block_bytes: int) -> None:
    """Raise `ConfigError` naming `what` if `value` bytes hold no block of `block_bytes`."""
    if value < block_bytes:
        raise ConfigError(f"{what}={value} holds no block of {block_bytes} bytes")


@register_tier("cpu")
@dataclass(frozen=True)
class CPUTierConfig(TierConfig):
    """`CPUTier` of `capacity_bytes` (whole blocks; pinned with CUDA).

    Attributes:
        checksums: keep an xxh3-64 of every block, checked before it is read or demoted.
        eviction: the eviction policy: a name ("lru", "s3fifo", "arc", "lfu"), a config
            (`S3FIFOConfig(small_share=0.2)`), or a dict with its `type`.
        admission: which evicted blocks are demoted to the tier below: "all", "seen:N", a
            config (`AdmitSeen(3)`) or a dict with its `type`; not one that needs the lower
            tier's victim (`tinylfu`).
        tenant_quota_bytes: a budget per tenant (None: no quotas, one eviction order).
    """

    tier = CPUTier

    capacity_bytes: int
    checksums: bool = False
    eviction: EvictionConfig = _LRU
    admission: AdmissionRule = ADMIT_ALL
    tenant_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        require_int("CPUTierConfig.capacity_bytes", self.capacity_bytes, 1)
        if not isinstance(self.checksums, bool):
            raise ConfigError(f"CPUTierConfig.checksums must be a bool, got {self.checksums!r}")
        object.__setattr__(self, "eviction", eviction_config(self.eviction, "CPUTierConfig.eviction"))
        object.__setattr__(self, "admission", demote_rule(self.admission, "CPUTierConfig.admission"))
        if self.tenant_quota_bytes is not None:
            require_int("CPUTierConfig.tenant_quota_bytes", self.tenant_quota_bytes, 1)

    def check(self, block_bytes: int, what: str) -> None:
        check_fits(f"{what}.capacity_bytes", self.capacity_bytes, block_bytes)
        if self.tenant_quota_bytes is not None:
            check_fits(f"{what}.tenant_quota_bytes", self.tenant_quota_bytes, block_bytes)

    def open(self, ctx: TierContext) -> Tier:
        quota = self.tenant_quota_bytes
        return CPUTier(self.capacity_bytes // ctx.block_bytes, ctx.block_shape, ctx.dtype,
                       verify_tokens=ctx.verify_tokens, checksum=self.checksums, eviction=self.eviction,
                       demote_admission=self.admission,
                       tenant_quota_blocks=None if quota is None else quota // ctx.block_bytes)
