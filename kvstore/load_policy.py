"""Load or recompute: load a cached prefix from a tier only where that beats recomputing it.

Every tier's load bandwidth is measured as loads happen (a running average of bytes per
second of each `get_into`), in decoded bytes over the whole call: a tier behind a codec
(`StoreConfig.disk_codec`, `remote_codec`) is measured at its effective bandwidth, raised by
the bytes a codec saves and lowered by its decoding time. The engine reports its prefill throughput (tokens per
second) as it prefills. For a prefix whose blocks sit in tiers t_1..t_n, loading block i
saves `block_size / prefill_rate - block_bytes / bandwidth(t_i)` seconds; the policy loads
the leading k blocks that save the most in total (k = 0: recompute it all). Costs are taken
as linear in tokens, which undercounts attention for long prefixes, so the policy errs
towards recomputing only where loading is clearly slower.

Modes: "auto" (the default), "always" (every cached block is loaded, the field's usual
fixed rule) and "never" (nothing is loaded from below the pool: full recompute, a baseline).
Until the prefill rate is known, "auto" loads everything; a tier not measured yet counts as
free (its first load measures it).

An engine whose scheduler runs in another process than the workers that measure (vLLM's
multiprocess mode) hands the scheduler's policy the workers' estimates instead (`adopt`).

Two guards keep "auto" from locking itself out of a tier:
- a sample no engine or device could produce (a prefill faster than `MAX_PREFILL_RATE`, a
  load faster than `MAX_LOAD_BANDWIDTH`, or a zero or negative duration) is rejected and
  counted (`num_samples_rejected`), never averaged in;
- a tier the policy stops loading from would never be measured again, so every
  `probe_every`-th decision that would recompute cached blocks loads them all instead (a
  probe, counted in `num_probes`): its loads refresh the tiers' bandwidths, and the policy
  goes back to loading from a tier that got faster (or once the engine's prefill got slower).
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Mapping, Sequence

from kvstore.errors import ConfigError
from tiers.keys import TierKind

_ALPHA = 0.3  # weight of a new measurement in the running averages
# Faster than any engine prefills (1e15 FLOP/s at 2 FLOPs per parameter and token is 5e6
# tokens/s for a 100M-parameter model): a sample this fast timed something else.
MAX_PREFILL_RATE = 1e8  # tokens per second
# Faster than any memory a tier reads from (HBM3e is ~5e12 bytes/s; tiers are CPU and below).
MAX_LOAD_BANDWIDTH = 1e13  # bytes per second
PROBE_EVERY = 32  # decisions that recompute cached blocks, per probe that loads them


def plausible_prefill_rate(rate: float) -> bool:
    """Whether an engine could prefill at `rate` tokens per second (finite, > 0, at most
    `MAX_PREFILL_RATE`)."""
    return isinstance(rate, float | int) and math.isfinite(rate) and 0 < rate <= MAX_PREFILL_RATE


def plausible_bandwidth(bandwidth: float) -> bool:
    """Whether a tier could load at `bandwidth` bytes per second (finite, > 0, at most
    `MAX_LOAD_BANDWIDTH`)."""
    return isinstance(bandwidth, float | int) and math.isfinite(bandwidth) and 0 < bandwidth <= MAX_LOAD_BANDWIDTH


class LoadPolicyMode(str, enum.Enum):
    """Which cached blocks a store's engine loads rather than recomputes."""

    AUTO = "auto"  # where loading beats recomputing at the measured rates (default)
    ALWAYS = "always"  # every cached block
    NEVER = "never"  # none from below the pool: a full-recompute baseline

    @classmethod
    def parse(cls, value: object, name: str = "load_policy") -> LoadPolicyMode:
        """A `LoadPolicyMode` from itself or its name; `ConfigError` naming the bad value."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}") from None


class LoadPolicy:
    """Running measures of tier bandwidth and prefill throughput, and the decision from them.

    Thread-safe: the engine's worker reports measurements while its scheduler decides."""

    def __init__(self, mode: LoadPolicyMode | str, block_size: int, block_bytes: int, *, probe_every: int = PROBE_EVERY,
                 free: frozenset[TierKind] = frozenset()) -> None:
        self.mode = LoadPolicyMode.parse(mode)
        # Tiers whose blocks the engine uses in place (its own paged memory): no load. The
        # store names those whose traits say so (`TierTraits.engine_memory`).
        self.free = free
        if not isinstance(probe_every, int) or isinstance(probe_every, bool) or probe_every < 1:
            raise ConfigError(f"LoadPolicy.probe_every must be an int >= 1, got {probe_every!r}")
        self.block_size, self.block_bytes = block_size, block_bytes
        self.probe_every = probe_every
        self._bandwidth: dict[TierKind, float] = {}  # bytes per second
        self._prefill_rate: float | None = None  # tokens per second
        self._lock = threading.Lock()
        self._skips_since_probe = 0  # decisions that recomputed cached blocks since the last probe
        self.num_blocks_skipped = 0  # cached blocks recomputed because loading them was slower
        self.num_probes = 0  # decisions that loaded everything to measure the tiers again
        self.num_samples_rejected = 0  # measurements no engine or device could produce

    @staticmethod
    def _mix(old: float | None, new: float) -> float:
        return new if old is None else (1 - _ALPHA) * old + _ALPHA * new

    def observe_load(self, kind: TierKind, num_bytes: int, seconds: float) -> None:
        """Record that `kind` delivered `num_bytes` in `seconds`, unless that is impossible
        (no time, or faster than `MAX_LOAD_BANDWIDTH`: counted in `num_samples_rejected`)."""
        if num_bytes <= 0:
            return
        with self._lock:
            if not seconds > 0 or num_bytes / seconds > MAX_LOAD_BANDWIDTH:
                self.num_samples_rejected += 1
                return
            self._bandwidth[kind] = self._mix(self._bandwidth.get(kind), num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> bool:
        """Record that the engine prefilled `num_tokens` in `seconds`; False (and counted) if
        the sample is impossible (no time, or faster than `MAX_PREFILL_RATE`)."""
        if num_tokens <= 0:
            return False
        with self._lock:
            if not seconds > 0 or num_tokens / seconds > MAX_PREFILL_RATE:
                self.num_samples_rejected += 1
                return False
            self._prefill_rate = self._mix(self._prefill_rate, num_tokens / seconds)
        return True

    def adopt(self, prefill_rate: float | None, bandwidths: Mapping[TierKind, float]) -> bool:
        """Replace the measures with estimates made elsewhere (the engine's workers, in another
        process): the prefill rate (None: not known yet) and each tier's bandwidth (a tier not
        named: not measured yet). False, changing nothing, if any is impossible (counted in
        `num_samples_rejected`)."""
        if (prefill_rate is not None and not plausible_prefill_rate(prefill_rate)) or not all(
                plausible_bandwidth(bw) for bw in bandwidths.values()):
            with self._lock:
                self.num_samples_rejected += 1
            return False
        with self._lock:
            self._prefill_rate = None if prefill_rate is None else float(prefill_rate)
            self._bandwidth = {kind: float(bw) for kind, bw in bandwidths.items()}
        return True

    def bandwidth(self, kind: TierKind) -> float | None:
        return self._bandwidth.get(kind)

    @property
    def prefill_rate(self) -> float | None:
        return self._prefill_rate

    def blocks_to_load(self, kinds: Sequence[TierKind]) -> int:
        """How many leading blocks of a cached prefix to load, given the tier each would come
        from (prefix order); the rest are recomputed. Blocks of `free` tiers (the pool) cost
        nothing to use. In "auto", counts the decision towards the next probe when it
        recomputes cached blocks, and answers "all of them" when that decision is the probe."""
        if self.mode is LoadPolicyMode.ALWAYS:
            return len(kinds)
        if self.mode is LoadPolicyMode.NEVER:
            return next((i for i, k in enumerate(kinds) if k not in self.free), len(kinds))
        with self._lock:
            rate, bandwidth = self._prefill_rate, dict(self._bandwidth)
            if rate is None:
                return len(kinds)
            recompute = self.block_size / rate
            saved = best = 0.0
            best_k = 0
            for i, kind in enumerate(kinds):
                bw = bandwidth.get(kind)
                load = 0.0 if kind in self.free or not bw else self.block_bytes / bw
                saved += recompute - load
                if saved >= best:
                    best, best_k = saved, i + 1
            if best_k == len(kinds):
                return best_k
            self._skips_since_probe += 1
            if self._skips_since_probe >= self.probe_every:
                self._skips_since_probe = 0
                self.num_probes += 1
                return len(kinds)
            self.num_blocks_skipped += len(kinds) - best_k
            return best_k
