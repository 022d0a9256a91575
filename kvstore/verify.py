"""Verify mode's check: KV an engine just computed against what each tier holds for the same
keys, and the quarantine of any block that differs.

Checksums and token ids catch damaged bytes; they cannot catch bytes that are intact but
wrong (a key built from an incomplete identity, a layout mix-up, another prefix's KV stored
under a key, a bug in a copy kernel). Given blocks the engine computed itself, every tier
holding one of their keys is read and compared, byte for byte where the tier keeps exact KV.
A block that differs in any tier is removed from every tier (its removal goes out as KV
events, so routers forget it), counted per tier, and named in one rate-limited warning.

Tiers that write a lossy codec return decoded values, not the computed bytes: their blocks
are counted as unverified, never compared or removed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiers.base import Tier
from tiers.keys import BlockKey, TierKind
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)


@dataclass(frozen=True)
class VerifyResult:
    """What one check found.

    Attributes:
        num_checked: (block, tier) pairs compared.
        mismatches: per tier, the indexes (into the keys given) of blocks whose bytes there
            differed from the computed ones.
        num_quarantined: blocks removed from every tier for a mismatch.
        num_unverified: (block, tier) pairs held by a tier that keeps lossy KV (not compared).
    """

    num_checked: int = 0
    mismatches: dict[TierKind, list[int]] = field(default_factory=dict)
    num_quarantined: int = 0
    num_unverified: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two blocks hold the same bytes (NaN patterns included, unlike `torch.equal`)."""
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def verify_blocks(tiers: Sequence[Tier], lossy: frozenset[TierKind], keys: Sequence[BlockKey],
                  computed: Sequence[torch.Tensor], namespace: str) -> VerifyResult:
    """Compare `computed[i]` with block `keys[i]` in every tier of `tiers` that holds it and
    remove each block that differs anywhere from every tier. The caller holds the store's
    lock; the tiers record the removals as changes."""
    checked = unverified = 0
    mismatches: dict[TierKind, list[int]] = {}
    bad: set[int] = set()
    scratch = torch.empty_like(computed[0].cpu()) if computed else None
    for tier in tiers:
        for i, key in enumerate(keys):
            if tier.match_prefix([key.block_hash]) != 1:
                continue
            if tier.kind in lossy:
                unverified += 1
                continue
            assert scratch is not None
            if tier.get_into([key], [scratch]) != 1:  # gone meanwhile, or damaged (the tier deleted it)
                continue
            checked += 1
            if not same_bytes(scratch, computed[i].cpu()):
                mismatches.setdefault(tier.kind, []).append(i)
                bad.add(i)
    if bad:
        hashes = [keys[i].block_hash for i in sorted(bad)]
        for tier in tiers:
            tier.discard(hashes)
        first = min(bad)
        where = ", ".join(f"{kind.value} ({len(idx)})" for kind, idx in mismatches.items())
        _warn(f"verify: namespace {namespace!r}: the KV held for {len(bad)} block(s) differs from the KV just "
              f"computed, in tier(s) {where}; first block {first} (hash {keys[first].block_hash.hex()[:16]}); "
              "removed from every tier")
    return VerifyResult(checked, mismatches, len(bad), unverified)
