"""`Lifecycle`: a store's background work and the order in which `close()` ends it.

Work that uses the tiers without the store's lock (prefetch reads, `flush`) runs inside
`outside()`; work queued for the I/O threads goes through `submit`. `begin_close()` marks the
store closing (new work is refused with `StoreClosedError`, queued work is told it may not
run), lets the I/O threads finish what they run, and waits until no use outside the lock is
left: only then may the tiers be closed. Nothing is ever cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from kvstore.errors import StoreClosedError

R = TypeVar("R")


class Lifecycle:
    """See the module docstring. Thread-safe.

    Invariant: once `closing` is True no new work starts; `begin_close` returns only when the
    I/O threads have stopped and no use of the tiers outside the store's lock is in progress.
    """

    def __init__(self, io_threads: int) -> None:
        self._io_threads = io_threads
        self._cond = threading.Condition(threading.Lock())  # guards the fields below
        self._closing = False
        self._num_outside = 0
        self._workers: ThreadPoolExecutor | None = None  # started on first use
        self.close_lock = threading.Lock()  # one close() at a time; a second waits, then returns

    @property
    def closing(self) -> bool:
        """Whether `begin_close` has been called."""
        return self._closing

    def refuse_if_closing(self) -> None:
        """Raise `StoreClosedError` once `begin_close` has been called."""
        if self._closing:
            raise StoreClosedError("KVCacheStore is closed")

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Use the tiers without the store's lock; `StoreClosedError` once closing.
        `begin_close` waits for every such use to end."""
        with self._cond:
            self.refuse_if_closing()
            self._num_outside += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_outside -= 1
                self._cond.notify_all()

    def submit(self, fn: Callable[..., R], *args: object, **kwargs: object) -> Future[R]:
        """Queue `fn` on the I/O threads (`io_threads` at a time); `StoreClosedError` once
        closing. `fn` must itself check `closing` if it may not run after `begin_close`."""
        with self._cond:
            self.refuse_if_closing()
            if self._workers is None:
                self._workers = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvstrata-io")
            return self._workers.submit(fn, *args, **kwargs)

    async def run_async(self, fn: Callable[..., R], *args: object, **kwargs: object) -> R:
        """`fn(*args, **kwargs)` on the I/O threads, awaited: `StoreClosedError` if closing
        began before it ran (it is then not run), never `asyncio.CancelledError`."""
        loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self.submit(self._unless_closing, fn, *args, **kwargs), loop=loop)

    def _unless_closing(self, fn: Callable[..., R], *args: object, **kwargs: object) -> R:
        self.refuse_if_closing()  # queued when close() began: not run
        return fn(*args, **kwargs)

    def begin_close(self) -> None:
        """Refuse new work, let the I/O threads finish (queued work sees `closing`), and wait
        until no use outside the lock is left."""
        with self._cond:
            self._closing = True
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown(wait=True)
        with self._cond:
            while self._num_outside:
                self._cond.wait()

