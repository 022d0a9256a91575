"""Record buffers the remote tier reuses: a store encodes into memory that is already faulted in.

A fresh buffer for each record costs more than the record itself: the kernel faults in and
zeroes every page (a 32 MiB record: ~40 ms here, against ~4 ms to copy into a reused one), and
the allocator hands large buffers back to the kernel when they are freed. Buffers of one
size class (the tier's largest record) go back here once the writer has sent their record and
are taken by the next store; reads receive values into them too (one per value, given back
once it is checked). At most `max_bytes` wait here; `trim` releases them all (the
writer calls it when it has been idle a while), so an idle tier holds no record memory.
"""

from __future__ import annotations

import threading

from tiers.shared.forks import renew_in_child


class RecordBuffers:
    """Free buffers of `size` bytes, at most `max_bytes` of them kept. Thread-safe.

    Invariant: a buffer is either here or lent out (encoding, queued, being sent, or
    receiving a value until it is checked), never both: `give` takes back only what its
    user finished with, and `take` removes it.
    """

    def __init__(self, size: int, max_bytes: int) -> None:
        self.size = size
        self._max = max(0, max_bytes) // max(1, size)
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self.num_reused = 0
        renew_in_child(self, "_lock")

    def take(self) -> bytearray:
        """A buffer of `size` bytes: a returned one if any (its bytes are stale), else new."""
        with self._lock:
            if self._free:
                self.num_reused += 1
                return self._free.pop()
        return bytearray(self.size)

    def give(self, buf: object) -> None:
        """Take back a buffer `take` lent whose record was sent (others are left to the
        garbage collector, as is any beyond the budget)."""
        if not isinstance(buf, bytearray) or len(buf) != self.size:
            return
        with self._lock:
            if len(self._free) < self._max:
                self._free.append(buf)

    def trim(self) -> None:
        """Release every free buffer (the memory goes back to the allocator)."""
        with self._lock:
            self._free.clear()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return len(self._free) * self.size
