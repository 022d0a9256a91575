"""Objects shared within one process by reference count, keyed by what opened them.

Used where a resource may be opened once per process only (an LMDB environment per file) or
should be shared by the parts of an engine living in one process (one store per config).
A forked child starts with an empty registry: the parent's objects are handed to
`forget_in_child` (e.g. to drop handles that must not cross `fork()`), never reused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    value: V
    refs: int = 0


class ProcessRegistry(Generic[K, V]):
    """`acquire` opens or shares; `release` closes with the last reference. Thread-safe."""

    def __init__(self, forget_in_child: Callable[[V], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[K, _Entry[V]] = {}
        self._forget_in_child = forget_in_child
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent may have held it while forking
        entries, self._entries = self._entries, {}
        if self._forget_in_child is not None:
            for entry in entries.values():
                self._forget_in_child(entry.value)

    def acquire(self, key: K, open_fn: Callable[[], V], on_share: Callable[[V], None] | None = None) -> V:
        """The value for `key`, opened by `open_fn` on first use (its errors propagate and
        register nothing); `on_share` runs on an existing value before it is shared again
        (its errors propagate and take no reference)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(open_fn())
            elif on_share is not None:
                on_share(entry.value)
            entry.refs += 1
            return entry.value

    def find(self, key: K) -> V | None:
        """The open value for `key`, if any; takes no reference."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.value

    def release(self, key: K, close_fn: Callable[[V], object]) -> None:
        """Drop one reference; the last one removes the value and passes it to `close_fn`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self._entries[key]
        close_fn(entry.value)

    def __len__(self) -> int:
        return len(self._entries)
