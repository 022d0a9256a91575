"""Verify mode's check: KV an engine just computed against what each tier holds for the same
keys, and the quarantine of any block that differs beyond its bound.

Checksums and token ids catch damaged bytes; they cannot catch bytes that are intact but
wrong (a key built from an incomplete identity, a layout mix-up, another prefix's KV stored
under a key, a bug in a copy kernel). Given blocks the engine computed itself, every tier
holding one of their keys is read and compared. A block that differs in any tier is removed
from every tier (its removal goes out as KV events, so routers forget it), counted per tier,
and named in one rate-limited warning with the error seen and the bound it broke.

The bound (`VerifyBound`): byte for byte in a store whose tiers all keep exact KV. Where a
tier writes a lossy codec, every element may differ by what that codec's round trips may
cost it: a decoded copy is encoded again where a block promoted from a lossy tier is demoted
back (or moves between lossy tiers), so the bound is the codec's `reencoded_error_bound` of
the computed block (after any number of round trips: 2-3x the one-trip `error_bound`, half
a quantization step of its group and the output rounding; `tiers/codecs/quant.py`), or its
`error_bound` if it states only that. It holds in every tier of such a store, since a block
promoted from or demoted to a lossy tier carries decoded values into exact tiers too. `tolerance`
adds, per element, that share of the block's largest magnitude, for engines whose numerics
vary with batch shape. A lossy codec that states no `error_bound` leaves the store's blocks
unverified in every tier (counted, never compared or removed): its decoded values reach the
other tiers too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from tiers.base import Tier
from tiers.codecs import Codec
from tiers.keys import BlockKey, TierKind
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)


@dataclass(frozen=True)
class TierCheck:
    """One tier's part of a check.

    Attributes:
        num_checked: blocks compared.
        max_error: the largest `|held - computed|` of any element compared (inf where the
            bytes differ but are not comparable as numbers).
        bound: the largest error any element compared was allowed (0: byte for byte).
        mismatches: indexes (into the keys given) of blocks beyond their bound.
    """

    num_checked: int = 0
    max_error: float = 0.0
    bound: float = 0.0
    mismatches: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    """What one check found.

    Attributes:
        num_checked: (block, tier) pairs compared.
        mismatches: per tier, the indexes (into the keys given) of blocks whose copy there
            differed from the computed one beyond the bound.
        num_quarantined: blocks removed from every tier for a mismatch.
        num_unverified: (block, tier) pairs held by a tier whose lossy codec states no bound.
        tiers: per tier compared, its count, bound and largest error seen.
    """

    num_checked: int = 0
    mismatches: dict[TierKind, list[int]] = field(default_factory=dict)
    num_quarantined: int = 0
    num_unverified: int = 0
    tiers: dict[TierKind, TierCheck] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass(frozen=True)
class VerifyBound:
    """How close a tier's copy must be to the KV just computed (see the module).

    Attributes:
        codecs: the lossy codecs the store's tiers write that state an `error_bound`.
        tolerance: per element, this share of the block's largest magnitude on top.
        element_dtype: the KV's element dtype (opaque uint8 blocks are viewed as it); None:
            the blocks' own dtype.
    """

    codecs: tuple[Codec, ...] = ()
    tolerance: float = 0.0
    element_dtype: torch.dtype | None = None

    @property
    def exact(self) -> bool:
        return not self.codecs and self.tolerance == 0

    def values(self, block: torch.Tensor) -> torch.Tensor | None:
        """`block`'s elements as float32 (flat); None if they are not floating-point numbers."""
        elem = self.element_dtype or block.dtype
        if not elem.is_floating_point:
            return None
        flat = block.detach().cpu().contiguous()
        if flat.dtype != elem:
            flat = flat.view(elem)
        return flat.reshape(-1).to(torch.float32)

    def allowed(self, computed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The largest error each element of `computed` (`values`: its elements, finite) may show."""
        out = torch.zeros_like(values)
        for codec in self.codecs:
            bound = getattr(codec, "reencoded_error_bound", None) or codec.error_bound  # type: ignore[attr-defined]
            out = torch.maximum(out, bound(computed).reshape(-1))
        if self.tolerance:
            out = out + self.tolerance * float(values.abs().max()) if values.numel() else out
        return out


def check_tolerance(value: object) -> float:
    """`value` as a verify tolerance: a number in [0, 1] (a share of each block's largest
    magnitude); `InvalidInputError` naming it otherwise (NaN, negative, above 1, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidInputError(f"verify tolerance must be a number in [0, 1] (a share of each block's largest "
                                f"magnitude; 0: exact), got {value!r}")
    return float(value)


def store_bound(config: StoreConfig, tolerance: float) -> tuple[VerifyBound, frozenset[TierKind]]:
    """The bound of a store's checks (see the module) and the tiers whose lossy codec states
    no `error_bound`."""
    codecs: list[Codec] = []
    unbounded: set[TierKind] = set()
    for t in config.tier_configs:
        if t.codec is None or not t.codec.kind.lossy:
            continue
        codec = t.codec.build(config.block_shape, config.layout.dtype, element_dtype=config.codec_dtype,
                              group=config.codec_group)
        if callable(getattr(codec, "error_bound", None)):
            codecs.append(codec)
        else:
            unbounded.add(t.tier.kind)
    return VerifyBound(tuple(codecs), tolerance, config.codec_dtype), frozenset(unbounded)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two blocks hold the same bytes (NaN patterns included, unlike `torch.equal`).
    A memcmp of their host bytes: `torch.equal` on uint8 runs 30x slower on a CPU."""
    if a.nbytes != b.nbytes:
        return False
    host = [t.detach().cpu().contiguous().view(torch.uint8).numpy() for t in (a, b)]
    return host[0].tobytes() == host[1].tobytes()


class Computed:
    """One block the engine computed, with what every tier's comparison needs of it worked
    out once: its host copy, its elements as float32 and each one's allowed error."""

    def __init__(self, block: torch.Tensor, bound: VerifyBound) -> None:
        self.block = block.detach().cpu()
        self.bound = bound
        self._worked = False
        self._values: torch.Tensor | None = None
        self._allowed: torch.Tensor | None = None

    def values(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(its elements as float32 or None if not numbers, each one's allowed error or None
        where only the bytes can be compared: an exact bound or a block that is not finite)."""
        if not self._worked:
            self._worked = True
            self._values = self.bound.values(self.block)
            if self._values is not None and not self.bound.exact and bool(torch.isfinite(self._values).all()):
                self._allowed = self.bound.allowed(self.block, self._values)
        return self._values, self._allowed


def compare(held: torch.Tensor, computed: Computed) -> tuple[bool, float, float]:
    """(whether `held` is within the bound of `computed`, the largest error seen, the largest
    error allowed). Byte for byte where the bound is exact, the elements are not numbers, or
    the computed block is not finite."""
    if computed.bound.exact and same_bytes(held, computed.block):  # the common case: no conversion
        return True, 0.0, 0.0
    b, allowed = computed.values()
    a = computed.bound.values(held)
    if a is None or b is None or allowed is None:
        if same_bytes(held, computed.block):
            return True, 0.0, 0.0
        err = float((a - b).abs().max()) if a is not None and b is not None and a.numel() else math.inf
        return False, err if math.isfinite(err) else math.inf, 0.0
    diff = (a - b).abs()
    within = bool((diff <= allowed).all())  # a NaN held where a number was computed is not
    err = float(diff.max()) if diff.numel() else 0.0
    return within, err if math.isfinite(err) else math.inf, float(allowed.max()) if allowed.numel() else 0.0


READ_BYTES = 4 << 20  # what verify reads from a tier in one call, at most (a block at least): fresh scratch past
# a few MiB costs more in page faults than the calls it saves (measured)


def _scratch(computed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host buffers for one read: as many blocks as fit in `READ_BYTES` (at least one)."""
    if not computed:
        return []
    one = computed[0]
    count = max(1, min(len(computed), READ_BYTES // max(1, one.numel() * one.element_size())))
    return list(torch.empty((count, *one.shape), dtype=one.dtype))


def _read(tier: Tier, keys: Sequence[BlockKey], held: Sequence[int],
          scratch: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Each block `keys[i]` (i in `held`) that `tier` gives, with its bytes (valid until the
    next one is taken), read in calls of up to `len(scratch)` blocks; one it no longer holds
    or finds damaged (then deleted by it) is skipped."""
    at = 0
    while at < len(held):
        batch = held[at : at + len(scratch)]
        got = tier.get_into([keys[i] for i in batch], scratch[: len(batch)])
        yield from zip(batch[:got], scratch[:got])
        at += got + (got < len(batch))  # a tier's read stops at a block it cannot give: skip that one


def verify_blocks(tiers: Sequence[Tier], unbounded: frozenset[TierKind], keys: Sequence[BlockKey],
                  computed: Sequence[torch.Tensor], namespace: str, bound: VerifyBound) -> VerifyResult:
    """Compare `computed[i]` with block `keys[i]` in every tier of `tiers` that holds it
    (but those in `unbounded`, whose lossy codec states no bound) and remove each block
    beyond `bound` anywhere from every tier; none is compared where `unbounded` names any
    (that codec's decoded values reach every tier). The caller holds the store's lock; the
    tiers record the removals as changes."""
    if unbounded:
        unbounded = frozenset(t.kind for t in tiers)
    unverified = 0
    checks: dict[TierKind, TierCheck] = {}
    bad: set[int] = set()
    refs = [Computed(block, bound) for block in computed]
    scratch = _scratch(computed)
    for tier in tiers:
        n, worst, most, wrong = 0, 0.0, 0.0, []
        held = [i for i, key in enumerate(keys) if tier.match_prefix([key.block_hash]) == 1]
        if tier.kind in unbounded:
            unverified += len(held)
            held = []
        for i, block in _read(tier, keys, held, scratch):
            n += 1
            within, err, allowed = compare(block, refs[i])
            worst, most = max(worst, err), max(most, allowed)
            if not within:
                wrong.append(i)
                bad.add(i)
        if n:
            checks[tier.kind] = TierCheck(n, worst, most, tuple(wrong))
    mismatches = {kind: list(c.mismatches) for kind, c in checks.items() if c.mismatches}
    if bad:
        hashes = [keys[i].block_hash for i in sorted(bad)]
        for tier in tiers:
            tier.discard(hashes)
        where = "; ".join(f"{kind.value}: {len(idx)} block(s), first block {idx[0]} (hash "
                          f"{keys[idx[0]].block_hash.hex()[:16]}), max error {checks[kind].max_error:.3g} against "
                          f"a bound of {checks[kind].bound:.3g}" for kind, idx in mismatches.items())
        _warn(f"verify: namespace {namespace!r}: the KV held for {len(bad)} block(s) differs from the KV just "
              f"computed: {where}; removed from every tier")
    return VerifyResult(sum(c.num_checked for c in checks.values()), mismatches, len(bad), unverified, checks)
