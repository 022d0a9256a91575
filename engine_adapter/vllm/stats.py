"""The connector's counters, kept in memory and (optionally) in a JSON file per process."""

from __future__ import annotations

import json
import os


class ConnectorStats:
    """Named counters of one connector role; `write()` puts them in `<path>/<role>-<pid>.json`."""

    def __init__(self, role: str, path: str | None) -> None:
        self.role, self.path = role, path
        self.counters: dict[str, int] = {}

    def count(self, name: str, n: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def write(self) -> None:
        if self.path is None:
            return
        os.makedirs(self.path, exist_ok=True)
        target = os.path.join(self.path, f"{self.role}-{os.getpid()}.json")
        tmp = target + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.counters, f, sort_keys=True)
        os.replace(tmp, target)
