"""The prefill-to-decode handoff through vLLM's `kv_transfer_params`, over kvstrata's durable
tiers: a `kv_producer` engine answers each finished request with `{"kvstrata": {"blocks": N}}`
(the prompt's full blocks it saved); a proxy passes that to the `kv_consumer` engine's request,
whose scheduler then waits (vLLM asks again each step) until its stores hold those N blocks,
at most `WAIT_S` seconds after its first look, then goes on with what they hold (counted)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

KEY = "kvstrata"  # kvstrata's entry in vLLM's kv_transfer_params
WAIT_S = 10.0  # a producer's saves land on disk within milliseconds; a lost one costs this wait
MAX_BLOCKS = 1 << 24


def offer(blocks: int) -> dict[str, Any] | None:
    """The `kv_transfer_params` a producer returns for a request whose first `blocks` blocks
    it saved (None for none)."""
    return {KEY: {"blocks": blocks}} if blocks > 0 else None


def promised(params: object) -> int | None:
    """The blocks a request's `kv_transfer_params` say a producer saved: None where they say
    nothing of kvstrata's; -1 where kvstrata's entry is malformed (to be counted, then ignored)."""
    if not isinstance(params, dict) or KEY not in params:
        return None
    entry = params[KEY]
    if isinstance(entry, dict) and "blocks" not in entry:
        return None  # hints only (`hints.py`)
    blocks = entry.get("blocks") if isinstance(entry, dict) else None
    if isinstance(blocks, int) and not isinstance(blocks, bool) and 0 <= blocks <= MAX_BLOCKS:
        return blocks
    return -1


class HandoffWaits:
    """Per request, when it was first looked up while its promised blocks were not all held."""

    def __init__(self, wait_s: float = WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s, self._clock = wait_s, clock
        self._since: dict[str, float] = {}
        self._gave_up: set[str] = set()  # waited out: not waited for again (a preempted request)

    def should_wait(self, req_id: str, held: int, promised_blocks: int) -> bool | None:
        """True: ask again later (fewer than `promised_blocks` held, within the wait); False:
        go on; None: go on, the wait ran out (the caller counts it)."""
        if held >= promised_blocks or req_id in self._gave_up:
            self._since.pop(req_id, None)
            return False
        first = self._since.setdefault(req_id, self._clock())
        if self._clock() - first < self.wait_s:
            return True
        del self._since[req_id]
        self._gave_up.add(req_id)
        return None

    def forget(self, req_id: str) -> None:
        """The request finished: nothing of it is kept."""
        self._since.pop(req_id, None)
        self._gave_up.discard(req_id)
