"""Blocking native calls with a deadline: a few daemon threads that run them, and the regions of
one registered transfer buffer they use.

Mooncake's client calls are native and blocking (a dead master makes a put retry for seconds),
so a caller never makes one itself: a worker thread does, and the caller waits until the
call's deadline. A call still running at its deadline is abandoned (a fault for the caller)
and keeps its worker and its region of the transfer buffer until it returns, so no later call
reads or writes bytes a late transfer may still touch. With every worker or region held by
abandoned calls, a call fails at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from tiers.shared.forks import renew_in_child

T = TypeVar("T")


class CallFailed(Exception):
    """A call did not complete: its deadline passed, no worker or region was free, or the call
    itself raised. The message says which."""


class _Job(Generic[T]):
    __slots__ = ("done", "error", "fn", "release", "result")

    def __init__(self, fn: Callable[[], T], release: Callable[[], None]) -> None:
        self.fn = fn
        self.release = release
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller, never raised in the worker
            self.error = exc
        finally:
            self.release()
            self.done.set()


class Regions:
    """A buffer of `num_regions * region_bytes` host bytes, page-aligned regions of it leased one to a
    call. Thread-safe."""

    def __init__(self, num_regions: int, region_bytes: int) -> None:
        self.region_bytes = region_bytes
        self.buffer = np.zeros(num_regions * region_bytes, dtype=np.uint8)
        self.address = int(self.buffer.ctypes.data)
        self.nbytes = int(self.buffer.nbytes)
        self._free = list(range(num_regions))
        self._num_regions = num_regions
        self._lock = threading.Lock()
        renew_in_child(self, "_lock")

    def _after_fork(self) -> None:
        """In a forked child: every region free (the calls that held regions do not exist here)."""
        self._free = list(range(self._num_regions))

    def take(self) -> int | None:
        """A free region's index (now leased), or None if every region is held."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, region: int) -> None:
        with self._lock:
            self._free.append(region)

    def view(self, region: int) -> memoryview:
        """The region's bytes (writable)."""
        start = region * self.region_bytes
        return memoryview(self.buffer[start : start + self.region_bytes].data).cast("B")

    def address_of(self, region: int) -> int:
        return self.address + region * self.region_bytes

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def check(self) -> None:
        with self._lock:
            if len(set(self._free)) != len(self._free) or not set(self._free) <= set(range(self._num_regions)):
                raise RuntimeError(f"transfer buffer regions out of order: free {self._free}")


class Workers:
    """`num` daemon threads that run calls; `run(fn, timeout_s)` waits for one at most that long."""

    def __init__(self, num: int, name: str) -> None:
        self._num, self._name = num, name
        self._closed = False
        self._start()
        renew_in_child(self, "_lock")

    def _start(self) -> None:
        self._jobs: queue.SimpleQueue[_Job[object] | None] = queue.SimpleQueue()
        self._idle = self._num
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, name=f"{self._name}-{i}", daemon=True)
                         for i in range(self._num)]
        for t in self._threads:
            t.start()

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock and workers of its own (the parent's threads, and
        the calls they ran, do not exist here; a call queued for them would never run)."""
        if not self._closed:
            self._start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def _free_worker(self) -> None:
        with self._lock:
            self._idle += 1

    def run(self, fn: Callable[[], T], timeout_s: float, release: Callable[[], None] | None = None) -> T:
        """`fn()` on a worker; its result, or `CallFailed` if it raised, if no worker is free,
        or if `timeout_s` passed first (then it runs on, and `release` runs when it returns;
        otherwise `release` runs before this returns)."""
        with self._lock:
            if self._idle == 0:
                if release is not None:
                    release()
                raise CallFailed("every call thread is held by a call that passed its deadline")
            self._idle -= 1

        def done() -> None:
            self._free_worker()
            if release is not None:
                release()

        job: _Job[T] = _Job(fn, done)
        self._jobs.put(job)  # type: ignore[arg-type]  # the queue holds jobs of any result
        if not job.done.wait(timeout_s):
            raise CallFailed(f"no answer within {timeout_s:.3g} s (the call was abandoned)")
        if job.error is not None:
            raise CallFailed(f"{type(job.error).__name__}: {job.error}") from None
        return job.result  # type: ignore[return-value]  # set when `fn` returned

    def close(self) -> None:
        """Stop the idle workers (a worker held by an abandoned call stops when it returns)."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
