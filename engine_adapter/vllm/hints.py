"""Per-request cache hints in vLLM's request channel: `kv_transfer_params = {"kvstrata": {...}}`.

    {"kvstrata": {"store": false}}      nothing of this request is cached by kvstrata
    {"kvstrata": {"load": false}}       nothing is loaded: the prompt is recomputed
    {"kvstrata": {"retain_s": 600}}     keep this request's blocks in the CPU tier through
                                        eviction pressure for 600 s (within the tenant's budget,
                                        `retain_share`; what does not fit is counted clipped)
    {"kvstrata": {"verify": true}}      compute a hit instead of loading it, and compare the
                                        computed KV with every tier's copy (verify mode)
    {"kvstrata": {"priority": "low"}}   eviction priority of the saved blocks (low, normal,
                                        high; `kvstore/priority.py`): low ones are the first
                                        victims; high ones stay within `retain_share`

Every hint is checked; a bad one (an unknown name, a wrong type, a value out of range) is
rejected alone, counted and warned about, and the others still apply. The response's
`kv_transfer_params` reports what was accepted and rejected (`{"kvstrata": {"hints": ...}}`).
`blocks` is the prefill-to-decode handoff's own entry (`handoff.py`), not a hint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.vllm.handoff import KEY
from kvstore.priority import PRIORITIES
from kvstore.retention import MAX_RETAIN_S

NAMES = ("store", "load", "retain_s", "verify", "priority")
NOT_HINTS = ("blocks",)  # other entries of kvstrata's params (the handoff's)


@dataclass(frozen=True)
class Hints:
    """A request's checked hints: what kvstrata does with it, and what it was told."""

    store: bool = True
    load: bool = True
    retain_s: float | None = None
    verify: bool = False
    priority: str | None = None  # "low", "normal" or "high"; None: not given
    accepted: tuple[str, ...] = ()
    rejected: dict[str, str] = field(default_factory=dict)  # name -> why

    def report(self) -> dict[str, Any] | None:
        """The response's entry for these hints (None where the request gave none)."""
        if not self.accepted and not self.rejected:
            return None
        return {"accepted": list(self.accepted), "rejected": dict(self.rejected)}


NONE = Hints()


def parse(params: object) -> Hints:
    """The hints in a request's `kv_transfer_params` (none: `NONE`)."""
    if not isinstance(params, dict) or KEY not in params:
        return NONE
    entry = params[KEY]
    if not isinstance(entry, dict):
        return Hints(rejected={KEY: f"must be an object of hints, got {type(entry).__name__}"})
    values: dict[str, Any] = {}
    accepted: list[str] = []
    rejected: dict[str, str] = {}
    for name, value in entry.items():
        if name in NOT_HINTS:
            continue
        if name not in NAMES:
            rejected[str(name)[:64]] = f"unknown hint (known: {', '.join(NAMES)})"
        elif name == "priority":
            if isinstance(value, str) and value in PRIORITIES:
                values[name] = value
                accepted.append(name)
            else:
                rejected[name] = f"must be one of {', '.join(PRIORITIES)}, got {str(value)[:64]!r}"
        elif name in ("store", "load", "verify"):
            if isinstance(value, bool):
                values[name] = value
                accepted.append(name)
            else:
                rejected[name] = f"must be true or false, got {str(value)[:64]!r}"
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and 0 < value <= MAX_RETAIN_S:
            values[name] = float(value)
            accepted.append(name)
        else:
            rejected[name] = f"must be a number of seconds in (0, {MAX_RETAIN_S:g}], got {str(value)[:64]!r}"
    return Hints(**values, accepted=tuple(accepted), rejected=rejected)
