"""Per-request eviction priority: "low", "normal" (the default) or "high" for a prefix's blocks.

- "low": the blocks become the next victims in every tier that orders its own eviction (the
  pool's free queue, the CPU tier, under any eviction policy: `EvictionPolicy.deprioritize`),
  the prefix's tail first, so a one-off job does not push out others' reusable blocks. A high
  block given "low" loses its protection first. The disk tier's LMDB order and shared servers
  are left as they are (`Tier.deprioritize` moves none there). A later use makes a block
  recent again, as any use does. With per-tenant quotas (`cpu_tenant_quota_bytes`) the quota
  rules still pick which tenant gives up a block; low blocks go first among that tenant's.
- "high": the blocks held in the memory tier below the engine are kept through eviction
  pressure with no deadline (`Retention.protect`), within the same per-tenant budget as
  `retain` (`StoreConfig.retain_share`): the tenant's oldest high blocks return to normal when
  its newer ones need the room; what does not fit (or is not held there) is reported clipped.
- "normal": ends "high" for the blocks; their place in eviction order is left as it is.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.errors import InvalidInputError
from kvstore.keying import key_hashes
from kvstore.retention import Retention
from kvstore.tier_stack import TierStack
from tiers.keys import BlockKey


class Priority(str, enum.Enum):
    """A prefix's eviction priority."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


PRIORITIES = tuple(p.value for p in Priority)


def parse_priority(value: object) -> Priority:
    """`value` (a `Priority` or its name) as a `Priority`; `InvalidInputError` naming it otherwise."""
    if isinstance(value, Priority):
        return value
    if isinstance(value, str):
        try:
            return Priority(value)
        except ValueError:
            pass
    raise InvalidInputError(f"priority must be one of {', '.join(PRIORITIES)}, got {value!r:.80}")


class PriorityResult(NamedTuple):
    """What `prioritize` did.

    Attributes:
        num_applied: blocks that now have the priority asked: for "low", the most moved to the
            eviction end in any one tier; for "high", blocks protected (newly or again); for
            "normal", blocks whose "high" it ended.
        num_clipped: "high" blocks it could not protect (over the tenant's budget, or not in
            the memory tier); 0 otherwise.
    """

    num_applied: int
    num_clipped: int


def prioritize(stack: TierStack, retention: Retention, keys: Sequence[BlockKey], priority: Priority) -> PriorityResult:
    """Give `keys`' blocks `priority` (see the module docstring); call with the store's lock held."""
    if priority is Priority.HIGH:
        kept = retention.protect(keys)
        return PriorityResult(kept.num_retained, kept.num_clipped)
    hashes = key_hashes(keys)
    ended = retention.unprotect(hashes)
    if priority is Priority.NORMAL:
        return PriorityResult(ended, 0)
    return PriorityResult(max((tier.deprioritize(hashes) for tier in stack.tiers), default=0), 0)
