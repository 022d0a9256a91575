"""Load or recompute: load a cached prefix from a tier only where that beats recomputing it.

Every tier's load bandwidth is measured as loads happen (a running average of bytes per
second of each `get_into`), and the engine reports its prefill throughput (tokens per
second) as it prefills. For a prefix whose blocks sit in tiers t_1..t_n, loading block i
saves `block_size / prefill_rate - block_bytes / bandwidth(t_i)` seconds; the policy loads
the leading k blocks that save the most in total (k = 0: recompute it all). Costs are taken
as linear in tokens, which undercounts attention for long prefixes, so the policy errs
towards recomputing only where loading is clearly slower.

Modes: "auto" (the default), "always" (every cached block is loaded, the field's usual
fixed rule) and "never" (nothing is loaded from below the pool: full recompute, a baseline).
Until the prefill rate is known, "auto" loads everything; a tier not measured yet counts as
free (its first load measures it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.errors import ConfigError
from tiers.base import TierKind

MODES = ("auto", "always", "never")
_ALPHA = 0.3  # weight of a new measurement in the running averages


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ConfigError(f"load_policy must be one of {list(MODES)}, got {mode!r}")
    return str(mode)


class LoadPolicy:
    """Running measures of tier bandwidth and prefill throughput, and the decision from them."""

    def __init__(self, mode: str, block_size: int, block_bytes: int) -> None:
        self.mode = check_mode(mode)
        self.block_size, self.block_bytes = block_size, block_bytes
        self._bandwidth: dict[TierKind, float] = {}  # bytes per second
        self._prefill_rate: float | None = None  # tokens per second
        self._lock = threading.Lock()
        self.num_blocks_skipped = 0  # cached blocks recomputed because loading them was slower

    @staticmethod
    def _mix(old: float | None, new: float) -> float:
        return new if old is None else (1 - _ALPHA) * old + _ALPHA * new

    def observe_load(self, kind: TierKind, num_bytes: int, seconds: float) -> None:
        """Record that `kind` delivered `num_bytes` in `seconds`."""
        if num_bytes > 0 and seconds > 0:
            with self._lock:
                self._bandwidth[kind] = self._mix(self._bandwidth.get(kind), num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Record that the engine prefilled `num_tokens` in `seconds`."""
        if num_tokens > 0 and seconds > 0:
            with self._lock:
                self._prefill_rate = self._mix(self._prefill_rate, num_tokens / seconds)

    def bandwidth(self, kind: TierKind) -> float | None:
        return self._bandwidth.get(kind)

    @property
    def prefill_rate(self) -> float | None:
        return self._prefill_rate

    def blocks_to_load(self, kinds: Sequence[TierKind]) -> int:
        """How many leading blocks of a cached prefix to load, given the tier each would come
        from (prefix order); the rest are recomputed. Pool blocks cost nothing to use."""
        if self.mode == "always":
            return len(kinds)
        if self.mode == "never":
            return next((i for i, k in enumerate(kinds) if k is not TierKind.POOL), len(kinds))
        with self._lock:
            rate, bandwidth = self._prefill_rate, dict(self._bandwidth)
        if rate is None:
            return len(kinds)
        recompute = self.block_size / rate
        saved = best = 0.0
        best_k = 0
        for i, kind in enumerate(kinds):
            bw = bandwidth.get(kind)
            load = 0.0 if kind is TierKind.POOL or not bw else self.block_bytes / bw
            saved += recompute - load
            if saved >= best:
                best, best_k = saved, i + 1
        self.num_blocks_skipped += len(kinds) - best_k
        return best_k
