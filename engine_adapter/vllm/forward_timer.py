"""Times vLLM's forward pass from the connector's hooks, for the load policy's prefill rate.

Where the forward pass runs, in vLLM 0.32 (`vllm/v1/worker/kv_connector_model_runner_mixin.py`
for the CPU and GPU model runners, `vllm/v1/worker/gpu/kv_connector.py` for the v2 GPU
runner): the step's metadata is bound (`bind_connector_metadata`) right before the forward
pass; `start_load_kv` runs before the forward pass when the step has synchronous loads
and right after it otherwise; the forward pass ends at `finish_forward` (v2 runner) or, at
the latest, at `wait_for_save`. So, whatever the order, the forward pass took the time from
the bind to the first end hook, less the time spent inside the connector's own loads in
between.

On a CUDA device the hooks run while kernels are still queued, so the marks are CUDA events
read once they have completed (a later step, never a wait); elsewhere, the wall clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

_MAX_PENDING = 64  # steps whose CUDA events have not completed yet; older ones are dropped


class _WallClock:
    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: Any) -> bool:
        return True

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


class _CudaClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        new_event: Callable[..., Any] = torch.cuda.Event  # torch leaves it unannotated
        event = new_event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0


@dataclass
class _Step:
    start: Any
    end: Any = None
    loads: list[tuple[Any, Any]] = field(default_factory=list)  # (start, end) of each load call
    num_tokens: int = 0


class ForwardTimer:
    """Per step: `begin` (bind), `loading()` around the connector's own loads, `end` (the
    first end hook wins), `finish(num_tokens)` (wait_for_save). `samples()` returns the
    (tokens, seconds) of the finished steps whose times are known; each once, in step order."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._clock = _CudaClock(device) if device is not None and device.type == "cuda" else _WallClock()
        self._step: _Step | None = None
        self._pending: deque[_Step] = deque(maxlen=_MAX_PENDING)

    def begin(self) -> None:
        """A step's forward pass is about to run (its metadata was just bound)."""
        self._step = _Step(self._clock.mark())

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Time the connector's own work inside the step, to leave it out of the forward's."""
        step = self._step
        if step is None or step.end is not None:
            yield
            return
        start = self._clock.mark()
        try:
            yield
        finally:
            step.loads.append((start, self._clock.mark()))

    def end(self) -> None:
        """The forward pass has ended (the first call of a step counts)."""
        if self._step is not None and self._step.end is None:
            self._step.end = self._clock.mark()

    def finish(self, num_tokens: int) -> None:
        """The step is over: keep its time for `samples()` if it prefilled `num_tokens` > 0."""
        self.end()
        step, self._step = self._step, None
        if step is not None and num_tokens > 0:
            step.num_tokens = num_tokens
            self._pending.append(step)

    def samples(self) -> list[tuple[int, float]]:
        """(tokens, seconds of forward pass) of each finished step whose marks are readable."""
        out: list[tuple[int, float]] = []
        clock = self._clock
        while self._pending and clock.ready(self._pending[0].end):
            step = self._pending.popleft()
            seconds = clock.seconds(step.start, step.end)
            seconds -= sum(clock.seconds(a, b) for a, b in step.loads)
            out.append((step.num_tokens, seconds))
        return out
