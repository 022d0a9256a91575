"""One rate-limited warning: the way every fault kvstrata counts is also told, without flooding."""

from __future__ import annotations

import logging
import math
import threading
import time

from tiers.shared.forks import renew_in_child

WARN_EVERY_S = 10.0


class RateLimitedWarning:
    """Logs "kvstrata: <message>" on `logger` at most every `every_s` seconds, saying how many
    were held back since the last one. Thread-safe; holds two numbers of state."""

    def __init__(self, logger: logging.Logger, every_s: float = WARN_EVERY_S) -> None:
        self._logger = logger
        self._every_s = every_s
        self._last = -math.inf
        self._held = 0
        self._lock = threading.Lock()
        renew_in_child(self, "_lock")

    def __call__(self, message: str) -> None:
        """Log `message` now if the last warning is `every_s` old, else count it as held back."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._every_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        tail = f" ({held} more like it since the last warning)" if held else ""
        self._logger.warning("kvstrata: %s%s", message, tail)
