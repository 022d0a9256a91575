"""One kind of call's faults and its circuit breaker, for the tiers on a server (remote, mooncake)."""

from __future__ import annotations

import logging
import threading
import time

from tiers.shared.forks import renew_in_child
from tiers.shared.ratelimit import RateLimitedWarning

FAILURES_TO_OPEN = 3  # consecutive failures that open a breaker


class Health:
    """The faults of one kind of call to a server (reads, or writes), and its breaker:
    after `FAILURES_TO_OPEN` consecutive faults no call of this kind is made for `cooldown_s`,
    then calls are tried again. Warnings go to `logger`, rate-limited. Thread-safe."""

    def __init__(self, kind: str, cooldown_s: float, logger: logging.Logger) -> None:
        self.kind = kind
        self.num_errors = 0
        self._cooldown_s = cooldown_s
        self._failures = 0
        self._open_until = 0.0
        self._lock = threading.Lock()
        self.warn = RateLimitedWarning(logger)
        renew_in_child(self, "_lock")

    def available(self) -> bool:
        """Whether calls of this kind are made now (the breaker is closed)."""
        return time.monotonic() >= self._open_until

    def fault(self, message: str) -> None:
        """Count a fault, open the breaker if they repeat, warn at most every `WARN_EVERY_S`."""
        with self._lock:
            self.num_errors += 1
            self._failures += 1
            if self._failures >= FAILURES_TO_OPEN:
                self._open_until = time.monotonic() + self._cooldown_s
        self.warn(message)

    def ok(self) -> None:
        """A call of this kind succeeded: the count of consecutive faults starts again."""
        with self._lock:
            self._failures = 0
