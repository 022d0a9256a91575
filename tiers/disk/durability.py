"""How durable a disk-tier write is when `store()` returns: `DiskSync`, and the group-commit
thread.

Every mode survives a killed process whole (the index commits only after the payload bytes
are written, and a transaction that dies rolls back). The modes differ on power loss:
- `COMMIT`: each write transaction `fdatasync`s its data files, then commits the index with
  LMDB's own syncs. Everything stored has reached the device when `store()` returns.
- `GROUP`: commits without syncing; a background thread syncs the data files, then the index,
  every `GROUP_INTERVAL_S` while there are unsynced writes. A power loss loses at most the
  writes of the last interval.
- `NONE`: the kernel writes back when it likes. A power loss may lose recent writes.
After a power loss in `GROUP` or `NONE`, an entry whose payload did not reach the device
fails its checksum: a miss, deleted, never wrong bytes. The index itself is LMDB without
sync in those modes (as `disk_sync=False` always was): LMDB keeps it consistent as long as
the file system keeps the order of its writes.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

from tiers.errors import ConfigError
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)
GROUP_INTERVAL_S = 0.2


class DiskSync(str, enum.Enum):
    """Durability of disk-tier writes (see the module docstring)."""

    NONE = "none"
    GROUP = "group"
    COMMIT = "commit"

    @classmethod
    def parse(cls, value: object, name: str = "disk_sync") -> DiskSync:
        """A `DiskSync` from itself, its name, or a bool (True: COMMIT, False: NONE, the
        meanings `disk_sync` had as a bool). Raises `ConfigError` naming the bad value."""
        if isinstance(value, DiskSync):
            return value
        if isinstance(value, bool):
            return cls.COMMIT if value else cls.NONE
        if isinstance(value, str):
            text = value.strip().lower()
            aliases = {"true": cls.COMMIT, "1": cls.COMMIT, "yes": cls.COMMIT, "on": cls.COMMIT,
                       "false": cls.NONE, "0": cls.NONE, "no": cls.NONE, "off": cls.NONE}
            if text in aliases:
                return aliases[text]
            for mode in cls:
                if text == mode.value:
                    return mode
        raise ConfigError(f"{name} must be a bool or one of none, group, commit; got {value!r}")


class GroupSync:
    """A thread that runs `sync` every `interval_s` while `mark()` was called since the last
    run. `close()` stops it after a last sync. A failing sync is counted and logged (at most
    once a minute), never raised: the writes it covers stay in the page cache."""

    def __init__(self, sync: Callable[[], None], what: str, interval_s: float = GROUP_INTERVAL_S) -> None:
        self._sync, self._what, self._interval = sync, what, interval_s
        self._dirty = False
        self._wake = threading.Event()
        self._stop = False
        self._warn = RateLimitedWarning(logger, every_s=60.0)
        self.num_syncs = self.num_failures = 0
        self._thread = threading.Thread(target=self._run, name="kvstrata-disk-sync", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        """Writes happened that the next sync must cover."""
        self._dirty = True

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._interval)
            if self._dirty:
                self._once()

    def _once(self) -> None:
        self._dirty = False
        try:
            self._sync()
            self.num_syncs += 1
        except Exception as exc:  # an OSError or lmdb.Error: counted, logged, retried next time
            self.num_failures += 1
            self._dirty = True
            self._warn(f"disk tier at {self._what}: group sync failed ({type(exc).__name__}: {exc}); retrying")

    def close(self) -> None:
        """Stop the thread, syncing what is left first."""
        self._stop = True
        self._wake.set()
        self._thread.join()
        if self._dirty:
            self._once()
