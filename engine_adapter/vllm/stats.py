"""The connector's counters, kept in memory, (optionally) in a JSON file per process, and
handed to vLLM's metrics as the increase since the last report (`take_deltas`)."""

from __future__ import annotations

import json
import os
import threading


class ConnectorStats:
    """Named counters of one connector role; `write()` puts them in `<path>/<role>-<pid>.json`.
    Thread-safe (the background save thread counts and writes too)."""

    def __init__(self, role: str, path: str | None) -> None:
        self.role, self.path = role, path
        self.counters: dict[str, int] = {}
        self._reported: dict[str, int] = {}  # the counters as of the last `take_deltas`
        self._written: dict[str, int] | None = None  # the counters as of the last `write`
        self._lock = threading.Lock()

    def count(self, name: str, n: int) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def set(self, name: str, value: int) -> None:
        """Set a counter that another object keeps (it only grows)."""
        with self._lock:
            self.counters[name] = value

    def take_deltas(self) -> dict[str, int]:
        """How much each counter grew since the last call (only those that did)."""
        with self._lock:
            deltas = {k: v - self._reported.get(k, 0) for k, v in self.counters.items()
                      if v > self._reported.get(k, 0)}
            self._reported.update((k, self.counters[k]) for k in deltas)
        return deltas

    def write(self, *, if_changed: bool = False) -> None:
        """Put the counters in this process's file (with `if_changed`, only if they changed
        since the last write): the file is current without waiting for a shutdown that a
        parent's kill may cut short."""
        if self.path is None:
            return
        with self._lock:
            if if_changed and self.counters == self._written:
                return
            self._written = dict(self.counters)
            os.makedirs(self.path, exist_ok=True)
            target = os.path.join(self.path, f"{self.role}-{os.getpid()}.json")
            tmp = f"{target}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.counters, f, sort_keys=True)
            os.replace(tmp, target)
