"""KVCacheStore's background work against clear() and close(): prefetch, the asyncio API, flush.

A gate on the real disk tier's reads holds a prefetch in the middle of its unlocked read, so the
interleaving under test happens every run; the tiers, threads and LMDB are all real.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from kvstore import (
    CloseResult,
    InvalidInputError,
    KVCacheStore,
    PrefetchResult,
    PrefetchStatus,
    StoreClosedError,
    StoreConfig,
)
from tests.conftest import BLOCK, LAYOUT, make_kv

TOKENS = list(range(4 * BLOCK))
WAIT_S = 10.0


def _config(path: Path, **kw: object) -> StoreConfig:
    return StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=16 * LAYOUT.block_bytes(BLOCK), disk_path=str(path),
                       disk_bytes=16 << 20, disk_sync=False, **kw)  # type: ignore[arg-type]


def _bits(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.view(torch.int16)


class DiskGate:
    """Holds the first call of the store's disk tier's `method` until `release()`: after the
    real call returns (a read: the bytes are read, the insert is still to come), or before it
    (`before=True`); later calls pass."""

    def __init__(self, store: KVCacheStore, method: str = "get_into", *, before: bool = False) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        disk = store.tiers[-1]
        self._call: Callable[..., object] = getattr(disk, method)
        self._before = before
        setattr(disk, method, self._gated)

    def _gated(self, *args: object) -> object:
        first = not self.entered.is_set()
        if first and self._before:
            self.entered.set()
            self._open.wait(WAIT_S)
        result = self._call(*args)
        if first and not self._before:
            self.entered.set()
            self._open.wait(WAIT_S)
        return result

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def on_disk(tmp_path: Path) -> Iterator[Callable[..., KVCacheStore]]:
    """Opens a store whose disk holds TOKENS with KV seed 1 and whose memory tiers are empty."""
    made: list[KVCacheStore] = []

    def open_store(**kw: object) -> KVCacheStore:
        with KVCacheStore(_config(tmp_path / "d", **kw)) as first:
            first.store(TOKENS, make_kv(len(TOKENS), seed=1))
        store = KVCacheStore(_config(tmp_path / "d", **kw))
        made.append(store)
        return store

    yield open_store
    for store in made:
        store.close()


def _wait_until_refused(store: KVCacheStore) -> tuple[bool, list[Future[PrefetchResult]]]:
    """Call prefetch until it raises StoreClosedError (close() has begun); the futures it gave."""
    accepted: list[Future[PrefetchResult]] = []
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            accepted.append(store.prefetch(TOKENS))
        except StoreClosedError:
            return True, accepted
        time.sleep(0.005)
    return False, accepted


def test_clear_voids_a_prefetch_whose_read_began_before_it(on_disk: Callable[..., KVCacheStore]) -> None:
    """A prefetch that read the old blocks before clear() inserts nothing after it: new KV
    stored for the same tokens is the KV retrieved."""
    store = on_disk()
    gate = DiskGate(store)
    prefetch = store.prefetch(TOKENS)
    assert gate.entered.wait(WAIT_S)
    store.clear()
    gate.release()
    result = prefetch.result(WAIT_S)
    assert result.status is PrefetchStatus.CLEARED and result.num_promoted == 0 and result.num_in_memory == 0
    assert not store.prefetched_blocks and store.lookup(TOKENS) == 0
    new = make_kv(len(TOKENS), seed=2)
    store.store(TOKENS, new)
    res = store.retrieve(TOKENS)
    assert res.num_tokens == len(TOKENS) and torch.equal(_bits(res.kv), _bits(new))
    store.check_integrity()


def test_an_astore_queued_before_clear_stores_nothing(on_disk: Callable[..., KVCacheStore]) -> None:
    store = on_disk(io_threads=1)
    gate = DiskGate(store)
    blocker = store.prefetch(TOKENS)  # holds the one I/O thread
    assert gate.entered.wait(WAIT_S)
    other = list(range(1000, 1000 + 2 * BLOCK))

    async def queue_then_clear() -> int:
        task = asyncio.ensure_future(store.astore(other, make_kv(len(other), seed=3)))
        await asyncio.sleep(0)  # the call is made (and queued) before the clear
        store.clear()
        gate.release()
        return await task

    assert asyncio.run(queue_then_clear()) == 0
    assert blocker.result(WAIT_S).status is PrefetchStatus.CLEARED
    assert store.lookup(other) == 0 and store.lookup(TOKENS) == 0


def test_store_with_an_older_generation_stores_nothing(on_disk: Callable[..., KVCacheStore]) -> None:
    store = on_disk()
    before = store.generation
    store.clear()
    assert store.generation == before + 1
    kv = make_kv(len(TOKENS), seed=2)
    assert store.store(TOKENS, kv, generation=before) == 0
    assert store.blocks.save(store.keys(TOKENS, num_blocks=1), [kv[:, :, :BLOCK]], generation=before) == (0, 0)
    assert store.lookup(TOKENS) == 0
    for bad in (before + 2, -1, "1", True):
        with pytest.raises(InvalidInputError, match=f"generation must be .* got {bad!r}"):
            store.store(TOKENS, kv, generation=bad)  # type: ignore[arg-type]
    assert store.stats().num_store_calls == 2  # the refused calls counted nothing
    assert store.store(TOKENS, kv, generation=store.generation) == len(TOKENS)


def test_close_resolves_queued_background_calls_without_cancelling_them(
        on_disk: Callable[..., KVCacheStore]) -> None:
    """Queued when close() begins: a prefetch resolves as CLOSED, an asyncio call raises
    StoreClosedError (not CancelledError); the running prefetch resolves as CLOSED too."""
    store = on_disk(io_threads=1)
    gate = DiskGate(store)
    running = store.prefetch(TOKENS)
    assert gate.entered.wait(WAIT_S)
    queued = [store.prefetch(TOKENS) for _ in range(3)]
    loop = asyncio.new_event_loop()
    submitted = threading.Event()

    async def queued_aretrieve() -> object:
        task = asyncio.ensure_future(store.aretrieve(TOKENS))
        await asyncio.sleep(0)
        submitted.set()
        try:
            return await task
        except BaseException as exc:  # CancelledError is a BaseException
            return exc

    waiter = threading.Thread(target=lambda: setattr(waiter, "result", loop.run_until_complete(queued_aretrieve())))
    waiter.start()
    assert submitted.wait(WAIT_S)
    closer = threading.Thread(target=store.close)
    closer.start()
    _wait_until_refused(store)
    gate.release()
    closer.join(WAIT_S)
    waiter.join(WAIT_S)
    loop.close()
    assert not closer.is_alive() and not waiter.is_alive()
    assert [f.result(WAIT_S).status for f in [running, *queued]] == [PrefetchStatus.CLOSED] * 4
    assert isinstance(waiter.result, StoreClosedError), repr(waiter.result)  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_closers", [1, 2])
def test_calls_while_close_waits_are_refused_and_no_thread_is_left(
        on_disk: Callable[..., KVCacheStore], num_closers: int) -> None:
    """Once close() has begun, background calls raise StoreClosedError (no new thread pool);
    every close() call, however many run at once, waits for the running read before the
    tiers close; then no thread the store started is left."""
    store = on_disk(io_threads=2)
    before = set(threading.enumerate())
    gate = DiskGate(store)
    running = store.prefetch(TOKENS)
    assert gate.entered.wait(WAIT_S)
    io_left: list[list[str]] = []

    def close() -> None:
        store.close()
        io_left.append([t.name for t in threading.enumerate() if t.name.startswith("kvstrata-io")])

    closers = [threading.Thread(target=close) for _ in range(num_closers)]
    for closer in closers:
        closer.start()
    refused, accepted = _wait_until_refused(store)
    try:
        assert refused, "prefetch was accepted all along while close() waited"
        assert not store.closed, "the tiers closed under a running prefetch's read"
        with pytest.raises(StoreClosedError):
            asyncio.run(store.aretrieve(TOKENS))
        with pytest.raises(StoreClosedError):
            asyncio.run(store.astore(TOKENS, make_kv(len(TOKENS))))
    finally:
        gate.release()
        for closer in closers:
            closer.join(WAIT_S)
    assert not any(closer.is_alive() for closer in closers)
    assert io_left == [[]] * num_closers, f"I/O threads alive when close() returned: {io_left}"
    assert running.result(WAIT_S).status is PrefetchStatus.CLOSED
    assert all(f.result(WAIT_S).status in (PrefetchStatus.CLOSED, PrefetchStatus.DROPPED) for f in accepted)
    left = [t.name for t in set(threading.enumerate()) - before]
    assert left == [], f"threads still running after close(): {left}"
    assert store.close() == CloseResult(0, 0)
    with pytest.raises(StoreClosedError):
        store.prefetch(TOKENS)


def test_close_waits_for_a_running_flush(on_disk: Callable[..., KVCacheStore]) -> None:
    """flush() runs without the store's lock: close() lets it finish before closing the tiers."""
    store = on_disk()
    store.retrieve(TOKENS)  # recency updates for the disk tier to flush
    gate = DiskGate(store, "flush", before=True)
    flushed: list[object] = []

    def flush() -> None:
        try:
            flushed.append(store.flush())
        except Exception as exc:
            flushed.append(exc)

    flusher = threading.Thread(target=flush)
    flusher.start()
    assert gate.entered.wait(WAIT_S)
    closer = threading.Thread(target=store.close)
    closer.start()
    refused, _ = _wait_until_refused(store)
    try:
        assert refused and not store.closed, "the tiers closed under a running flush()"
    finally:
        gate.release()
        flusher.join(WAIT_S)
        closer.join(WAIT_S)
    assert flushed == [True] and store.closed
