"""The load policy's rates, carried from the workers that measure them to the scheduler that
decides (vLLM's multiprocess mode, tensor and pipeline parallelism).

Each worker's store measures vLLM's prefill rate (`forward_timer.py`) and each tier's load
bandwidth as it loads. When the scheduler runs in another process, it sees none of that: each
worker hands its estimates (`WorkerRates`, in units every worker shares: seconds per token,
seconds per block) to vLLM's worker-to-scheduler channel (`build_connector_worker_meta`),
vLLM gathers every worker's for the step, and the scheduler keeps the latest of each worker
(`RatesBook`) and gives its policy the merged rates:

- prefill: a step's forward runs through the pipeline stages in turn and the tensor-parallel
  ranks of a stage together, so the engine's seconds per token are the sum over stages of the
  slowest rank's (unknown until every stage has reported);
- loads: every worker loads its part of a hit at once, so a tier costs what the slowest
  worker takes for a block. The scheduler's view of the store has no CPU tier (it reads the
  disk the workers write through to): a block the worker serves from its CPU tier is one the
  scheduler sees on the view's first tier, so each worker's tiers count towards the view's
  kinds in proportion to the blocks each served recently (`TierShares`).

No vLLM import: the connector wraps these in vLLM's metadata class.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.load_policy import LoadPolicy, plausible_bandwidth, plausible_prefill_rate
from tiers.keys import TierKind

_ALPHA = 0.3  # weight of a load's block counts in the recent shares
MAX_REPORTS = 4096  # worker reports one step may carry: more is not from vLLM's workers


class TierShares:
    """How many blocks each tier served recently: a running average of each load's counts.
    Thread-safe (background loads count too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shares: dict[TierKind, float] = {}

    def add(self, blocks_per_tier: Mapping[TierKind, int]) -> None:
        """Count one load that took `blocks_per_tier` from each tier (0 for the tiers not named)."""
        if not blocks_per_tier:
            return
        with self._lock:
            for kind in set(self._shares) | set(blocks_per_tier):
                self._shares[kind] = (1 - _ALPHA) * self._shares.get(kind, 0.0) + _ALPHA * blocks_per_tier.get(kind, 0)

    def snapshot(self) -> dict[TierKind, float]:
        with self._lock:
            return dict(self._shares)


@dataclass(frozen=True)
class WorkerRates:
    """One worker's estimates. `tiers`: (tier name, seconds per block, recent share) of each
    tier it has measured. Plain values only: it travels between processes."""

    pp_rank: int
    tp_rank: int
    prefill_s_per_token: float | None
    tiers: tuple[tuple[str, float, float], ...] = ()


def worker_rates(policy: LoadPolicy, shares: TierShares, pp_rank: int, tp_rank: int) -> WorkerRates:
    """What the worker at (`pp_rank`, `tp_rank`) reports of its store's `policy` now."""
    rate = policy.prefill_rate
    tiers = []
    for kind, share in sorted(shares.snapshot().items()):
        bandwidth = policy.bandwidth(kind)
        if bandwidth:
            tiers.append((kind.value, policy.block_bytes / bandwidth, share))
    return WorkerRates(pp_rank, tp_rank, 1.0 / rate if rate else None, tuple(tiers))


def _finite(x: object, *, positive: bool) -> bool:
    return (isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x)
            and (x > 0 if positive else x >= 0))


class RatesBook:
    """The scheduler's record of the latest rates of each worker, and the policy's merge of them.

    `view_kinds`: the tiers of the scheduler's view of the store, fastest first;
    `known_kinds`: the tier names a worker may report (others are refused, never interned).
    Refused reports are counted in `rejected` and change nothing."""

    def __init__(self, tp_size: int, pp_size: int, block_bytes: int, view_kinds: Sequence[TierKind],
                 known_kinds: frozenset[str]) -> None:
        self.tp_size, self.pp_size, self.block_bytes = tp_size, pp_size, block_bytes
        self.view_kinds = list(view_kinds)
        self.known_kinds = known_kinds
        self.rejected = 0
        self._latest: dict[tuple[int, int], WorkerRates] = {}

    def _valid(self, r: object) -> bool:
        """Whether `r` is a report a worker of this engine could send (no impossible rate)."""
        if not isinstance(r, WorkerRates):
            return False
        if not (type(r.pp_rank) is int and 0 <= r.pp_rank < self.pp_size
                and type(r.tp_rank) is int and 0 <= r.tp_rank < self.tp_size):
            return False
        s = r.prefill_s_per_token
        if s is not None and not (_finite(s, positive=True) and plausible_prefill_rate(1.0 / s)):
            return False
        if not isinstance(r.tiers, tuple) or len(r.tiers) > len(self.known_kinds):
            return False
        names = set()
        for entry in r.tiers:
            if not (isinstance(entry, tuple) and len(entry) == 3):
                return False
            name, seconds, share = entry
            if (not isinstance(name, str) or name not in self.known_kinds or name in names
                    or not _finite(seconds, positive=True) or not _finite(share, positive=False)
                    or not plausible_bandwidth(self.block_bytes / seconds)):
                return False
            names.add(name)
        return True

    def take(self, reports: Sequence[object]) -> bool:
        """Record one step's reports (the latest of each worker wins); True if any was new."""
        if len(reports) > MAX_REPORTS:
            self.rejected += 1
            return False
        changed = False
        for r in reports:
            if not self._valid(r):
                self.rejected += 1
                continue
            assert isinstance(r, WorkerRates)
            key = (r.pp_rank, r.tp_rank)
            if self._latest.get(key) != r:
                self._latest[key] = r
                changed = True
        return changed

    def prefill_rate(self) -> float | None:
        """The engine's tokens per second: each stage's slowest rank, stages in turn (None until
        every stage has reported one)."""
        per_stage: dict[int, float] = {}
        for (pp, _), r in self._latest.items():
            if r.prefill_s_per_token is not None:
                per_stage[pp] = max(per_stage.get(pp, 0.0), r.prefill_s_per_token)
        if len(per_stage) < self.pp_size:
            return None
        return 1.0 / sum(per_stage.values())

    def _view_kind(self, name: str) -> TierKind | None:
        """The kind the scheduler's view sees a block under that a worker served from tier `name`:
        the same tier, or (a tier the view lacks: the worker's CPU tier) the view's first."""
        kind = TierKind(name)  # a known name (validated): interned already
        if kind in self.view_kinds:
            return kind
        return self.view_kinds[0] if self.view_kinds else None

    def bandwidths(self) -> dict[TierKind, float]:
        """Bytes per second of a block (this scheduler's `block_bytes`) from each kind of its
        view: the slowest worker's seconds per block, each worker's tiers weighted by the
        blocks they served recently."""
        slowest: dict[TierKind, float] = {}
        for r in self._latest.values():
            cost: dict[TierKind, list[float]] = {}  # view kind -> [sum of share * seconds, sum of shares]
            for name, seconds, share in r.tiers:
                kind = self._view_kind(name)
                if kind is None or share <= 0:
                    continue
                acc = cost.setdefault(kind, [0.0, 0.0])
                acc[0] += share * seconds
                acc[1] += share
            for kind, (weighted, total) in cost.items():
                slowest[kind] = max(slowest.get(kind, 0.0), weighted / total)
        return {kind: self.block_bytes / seconds for kind, seconds in slowest.items() if seconds > 0}

    def apply(self, policy: LoadPolicy) -> bool:
        """Give `policy` the merged rates; False if it refused them (counted in `rejected`)."""
        if policy.adopt(self.prefill_rate(), self.bandwidths()):
            return True
        self.rejected += 1
        return False
