"""One call's lanes run at once, on the caller's thread and a bounded pool of worker threads.

A large read or write of the remote tier is split into lanes, each on connections of its own
(`tiers/remote/client.py`, `Server.stream`): socket I/O and the copies release the GIL, so
lanes overlap. Each lane is offered to a worker and tried by the caller as well: whichever
thread claims it first runs it, so a lane never waits for a busy worker (the caller runs what
no worker took), the pool never holds more than `workers` threads, and `run` returns only when
every lane has ended, so no lane touches the caller's memory after its call returned. A lane
must end by itself (the remote tier's lanes run under their call's deadline).

A forked child (vLLM forks its workers) has none of its parent's threads: its `Lanes` start a
pool of their own (`tiers/shared/forks.py`), so no lane is queued for a worker that never comes,
holding the call's buffers. Once the interpreter is shutting down (a store closed from an
`atexit` handler) no worker can be started: every lane runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tiers.shared.forks import renew_in_child

T = TypeVar("T")


class Lanes:
    """Runs a call's lanes in parallel on at most `workers` threads besides the caller's.
    Thread-safe; after `close` every lane runs on its caller's thread."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self._name = name
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) if workers else None
        self._lock = threading.Lock()
        renew_in_child(self, "_lock")

    def _after_fork(self) -> None:
        """In a forked child: a pool of its own (the parent's workers do not exist here)."""
        if self._pool is not None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self._name)

    def run(self, lanes: Sequence[Callable[[], T]]) -> list[T | Exception]:
        """Each lane's result (or the exception it raised), in order, once every lane ended.
        A `BaseException` (Ctrl-C) raised in the caller's thread is raised once the lanes
        under way have ended, and the lanes not yet started never start."""
        results: list[T | Exception | None] = [None] * len(lanes)
        claimed = [threading.Lock() for _ in lanes]
        ended = [threading.Event() for _ in lanes]

        def attempt(k: int) -> None:
            if not claimed[k].acquire(blocking=False):
                return  # another thread runs it
            try:
                results[k] = lanes[k]()
            except Exception as exc:  # handed to the caller, which decides
                results[k] = exc
            finally:
                ended[k].set()

        with self._lock:
            if self._pool is not None:
                try:
                    for k in range(1, len(lanes)):  # lane 0 is the caller's
                        self._pool.submit(attempt, k)
                except RuntimeError:  # the interpreter is shutting down: no worker starts now
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
        try:
            for k in range(len(lanes)):
                attempt(k)
        finally:  # also on a KeyboardInterrupt in the caller's lane: no lane outlives the call
            for k in range(len(lanes)):
                if claimed[k].acquire(blocking=False):  # not started: no thread will start it now
                    ended[k].set()
            for event in ended:
                event.wait()
        return results  # type: ignore[return-value]  # every slot is set once its lane ended

    def close(self) -> None:
        """Stop the workers once their lanes end (without waiting); later lanes run on the caller's thread."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.shutdown(wait=False, cancel_futures=True)
