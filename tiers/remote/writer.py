"""The remote tier's write queue: records wait within a byte budget; a thread sends them.

`put` queues one call's records in the order given (parents before children) and, when the
budget is spent, waits for the writer to make room (backpressure) instead of dropping. It gives
up only when the writer makes no progress for `stall_s`; then the rest of that call is dropped,
a contiguous tail. Once a record of a call is dropped or refused by the server, none of that
call's later records is sent either, so a drop never leaves a hole before kept blocks. Every
drop is reported to `on_drop`.

While a `put` is still producing records the writer waits (up to `linger_s`) until
`min_batch_bytes` are queued: a writer that sent each record as it came would send batches of
one, each a round trip of its own. After `idle_s` with nothing queued it calls `on_idle` (the
tier releases its reused record buffers).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import NamedTuple

from tiers.keys import BlockKey
from tiers.shared.forks import renew_in_child


class Record(NamedTuple):
    """One value to `SET`, the `put` call (group) it came from, and the block it holds."""

    group: int
    key: bytes
    value: memoryview
    block: BlockKey


class Cancelled(NamedTuple):
    """What `WriteQueue.cancel` did: the queued records it took off (never sent; their
    buffers are the caller's again) and whether no batch in flight still holds one of the
    keys (False: one was still being sent when the wait ran out)."""

    records: list[Record]
    settled: bool


# Sends a batch; returns, for each record, whether the server stored it.
Send = Callable[[list[Record]], list[bool]]
OnDrop = Callable[[int, str], None]  # (records dropped, why)


class WriteQueue:
    """Records waiting for the server, oldest first, and the thread that sends them.

    Invariants: `queued_bytes` is the sum of the waiting records' sizes; it exceeds
    `max_pending_bytes` only while a single record larger than the budget waits alone. The
    records of one group are sent in the order `put` got them, and none after a dropped or
    refused one.
    """

    def __init__(self, send: Send, on_drop: OnDrop, *, max_pending_bytes: int, batch_bytes: int,
                 stall_s: float, min_batch_bytes: int = 4 << 20, linger_s: float = 0.01,
                 on_idle: Callable[[], None] | None = None, idle_s: float = 5.0) -> None:
        self._send = send
        self._on_drop = on_drop
        self._on_idle = on_idle  # called (holding the condition) after `idle_s` with nothing queued
        self._idle_s = idle_s
        self._max_pending_bytes = max_pending_bytes
        self._batch_bytes = batch_bytes
        self._min_batch_bytes = min(min_batch_bytes, max_pending_bytes)
        self._linger_s = linger_s
        self._stall_s = stall_s
        self._cond = threading.Condition()
        self._queue: deque[Record] = deque()
        self.queued_bytes = 0
        self._in_flight = 0
        self._in_flight_keys: frozenset[bytes] = frozenset()  # the server keys of the batch being sent
        self._progress = 0  # batches taken off the queue so far
        self._groups = 0
        self._failed: set[int] = set()  # groups with a record the server refused
        self._active: set[int] = set()  # groups whose put is running
        self._closed = False
        self._writer = threading.Thread(target=self._loop, name="kvstrata-remote-writer", daemon=True)
        self._writer.start()
        renew_in_child(self)

    def _after_fork(self) -> None:
        """In a forked child: an empty queue (what the parent queued is the parent's to send, or
        it would land after the parent's later deletes) and a writer of its own (the parent's
        does not exist here, so nothing queued would ever be sent)."""
        self._cond = threading.Condition()
        self._queue = deque()
        self.queued_bytes = self._in_flight = 0
        self._in_flight_keys = frozenset()
        self._failed, self._active = set(), set()
        if not self._closed:
            self._writer = threading.Thread(target=self._loop, name="kvstrata-remote-writer", daemon=True)
            self._writer.start()

    def put(self, records: Iterable[tuple[bytes, memoryview, BlockKey]], count: int) -> int:
        """Queue `count` records (server key, value, block) of one call in order (each produced
        only when it is its turn), waiting for room; return how many were queued. The rest, a
        contiguous tail, is dropped (and reported) if the writer makes no progress for
        `stall_s`, an earlier record of this call was refused, or the queue closes."""
        with self._cond:
            self._groups += 1
            group = self._groups
            self._active.add(group)
        queued = 0
        why = "the tier is closing"
        try:
            for key, value, block in records:
                with self._cond:
                    why = self._wait_for_room(group, value.nbytes)
                    if why:
                        break
                    self._queue.append(Record(group, key, value, block))
                    self.queued_bytes += value.nbytes
                    queued += 1
                    if len(self._queue) == 1 or self.queued_bytes >= self._min_batch_bytes:
                        self._cond.notify_all()  # the writer waits for a first record or a batch
        finally:
            with self._cond:
                self._active.discard(group)
                self._cond.notify_all()
        if queued < count:
            self._on_drop(count - queued, why)
        return queued

    def _wait_for_room(self, group: int, size: int) -> str:
        """Wait (holding the condition) until `size` bytes fit; '' then, else why not."""
        progress, stalled_at = self._progress, time.monotonic() + self._stall_s
        while self._queue and self.queued_bytes + size > self._max_pending_bytes:
            if self._closed or group in self._failed:
                break
            if self._progress != progress:
                progress, stalled_at = self._progress, time.monotonic() + self._stall_s
            left = stalled_at - time.monotonic()
            if left <= 0:
                return f"the write queue stayed full ({self.queued_bytes >> 20} MiB) for {self._stall_s:.1f} s"
            self._cond.wait(left)
        if self._closed:
            return "the tier is closing"
        if group in self._failed:
            return "an earlier block of the same write was not stored"
        return ""

    def _take_batch(self) -> list[Record] | None:
        """The next batch (holding the condition); None once closed and empty. Records of
        failed groups are dropped here (reported before `flush` can see the queue empty),
        and every record once closed."""
        while not self._queue and not self._closed:
            if not self._cond.wait(self._idle_s) and not self._queue and self._on_idle is not None:
                self._on_idle()
        linger_until = time.monotonic() + self._linger_s
        while self._active and not self._closed and self.queued_bytes < self._min_batch_bytes:
            left = linger_until - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)  # a put is producing: let a batch gather
        if not self._queue:
            return None
        batch: list[Record] = []
        size = skipped = 0
        while self._queue and size < self._batch_bytes:
            record = self._queue.popleft()
            self.queued_bytes -= record.value.nbytes
            if self._closed or record.group in self._failed:
                skipped += 1
                continue
            batch.append(record)
            size += record.value.nbytes
        # A failed group matters while its records are queued or its put is still running.
        oldest = self._queue[0].group if self._queue else self._groups + 1
        self._failed = {g for g in self._failed if g >= oldest or g in self._active}
        if skipped:
            self._on_drop(skipped, "the tier is closing" if self._closed else
                          "an earlier block of the same write was not stored")
        self._progress += 1
        self._in_flight = len(batch)
        self._in_flight_keys = frozenset(r.key for r in batch)
        self._cond.notify_all()
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._take_batch()
            if batch is None:
                return
            failed: set[int] = set()
            if batch:
                why = "the server did not store them"
                try:
                    stored = self._send(batch)
                except Exception as exc:  # a bug in send must not stop the writer
                    stored, why = [False] * len(batch), f"the writer failed ({type(exc).__name__}: {exc})"
                failed = {r.group for r, ok in zip(batch, stored) if not ok}
                if failed:
                    self._on_drop(sum(1 for ok in stored if not ok), why)
            with self._cond:
                self._failed |= failed
                self._in_flight = 0
                self._in_flight_keys = frozenset()
                self._cond.notify_all()

    def cancel(self, keys: Collection[bytes], timeout_s: float) -> Cancelled:
        """Take every queued record of `keys` (server keys) off the queue, so none is sent,
        then wait (up to `timeout_s`) until no batch in flight holds one of them: a delete of
        those keys made after this returns settled cannot be undone by a write queued before
        it. Later records of the same `put` are still sent (a delete never drops a child)."""
        wanted = frozenset(keys)
        end = time.monotonic() + timeout_s
        with self._cond:
            taken = [r for r in self._queue if r.key in wanted]
            if taken:
                self._queue = deque(r for r in self._queue if r.key not in wanted)
                self.queued_bytes -= sum(r.value.nbytes for r in taken)
                self._cond.notify_all()  # room for puts waiting; `flush` may see the queue empty
            while self._in_flight and not wanted.isdisjoint(self._in_flight_keys):
                left = end - time.monotonic()
                if left <= 0:
                    return Cancelled(taken, False)
                self._cond.wait(left)
        return Cancelled(taken, True)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every record queued so far was sent or dropped; False if `timeout_s`
        passed first."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float, join_s: float) -> None:
        """Flush for up to `timeout_s`, drop (and report) what is left, stop the writer (waiting
        up to `join_s` for a batch in flight). Idempotent."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(join_s)

    def check_integrity(self) -> None:
        with self._cond:
            if self.queued_bytes != sum(r.value.nbytes for r in self._queue) or self.queued_bytes < 0:
                raise RuntimeError("remote write queue: queued byte count disagrees with the queue (a bug)")
