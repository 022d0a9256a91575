"""`timed`: report the wall time of a call to its owner's `observe_latency` hook.

A timed call made inside another one on the same thread (the token API's `retrieve` loading
through the engine API's `load`) is not reported apart: each public call is observed once,
under its own name.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class Observed(Protocol):
    """Anything with an optional latency hook (`kvstore.metrics.register_metrics` sets it)."""

    @property
    def observe_latency(self) -> Callable[[str, float], None] | None: ...


S = TypeVar("S", bound=Observed)
_inside = threading.local()  # `active`: a timed call is running on this thread


def timed(op: str) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]]:
    """Decorate a method: its wall time is reported as `(op, seconds)` to the owner's
    `observe_latency` when one is set (nothing is timed otherwise), unless it runs inside
    another timed call."""

    def wrap(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            hook = self.observe_latency
            if hook is None or getattr(_inside, "active", False):
                return fn(self, *args, **kwargs)
            _inside.active = True
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                _inside.active = False
                hook(op, time.perf_counter() - t0)

        functools.update_wrapper(run, fn)  # name and docstring of the wrapped call
        return run

    return wrap
