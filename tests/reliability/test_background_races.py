"""Random programs of prefetch, clear, store, retrieve, lookup, flush, the asyncio API and close,
run at once on several threads against one real store: a CPU tier (or a pool, or both) over a
real LMDB disk tier, or a CPU tier over a real redis-server.

KV bytes are a pure function of (token prefix, generation), the generation being the number of
`clear()` calls so far, so a block stored before a clear is told from one stored after it.
Stores hold a shared gate that clear() takes alone (a caller that never stores KV computed
before a clear after it); everything else (prefetch, retrieve, lookup, flush, close, and the
queued asyncio calls) races the clear freely. Checked:
- every retrieved prefix is one generation's bytes, of a generation current at some moment of
  the call: never bytes from before a clear that completed before the call began;
- before `close()` no call raises; after it only `StoreClosedError`; a prefetch future never
  raises (0 after close); nothing hangs;
- `check_integrity()` holds and, once all threads are done, every prompt's cached prefix is the
  latest generation's bytes;
- after `close()` no thread the store started is left (`threading.enumerate()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.redis_servers import redis_server
from kvstore import KVCacheStore, PrefetchResult, PrefetchStatus, StoreClosedError

from .budget import BUDGET
from .conftest import Figures
from .kvgen import SMALL_BLOCK, SMALL_LAYOUT, make_kv, open_store

B = SMALL_BLOCK
_ROOTS = [np.random.default_rng([BUDGET.seed, 120, r]).integers(0, 50_000, size=4 * B, dtype=np.uint32)
          for r in range(3)]
# Eight prompts over three shared roots, two to four blocks, some with a partial tail block.
PROMPTS = [np.concatenate([_ROOTS[i % 3][: (2 + i % 3) * B], np.arange(i % 3, dtype=np.uint32)])
           for i in range(8)]
# 3 CPU blocks: prompts demote to disk all the time, so prefetch has work to do. Disk reads
# capped at ~1 ms a block (`disk_read_bps`, a real option): the reads a prefetch makes without
# the lock last long enough for other threads' calls to land in between.
_CPU = 3 * SMALL_LAYOUT.block_bytes(B)
_SLOW = SMALL_LAYOUT.block_bytes(B) * 1000
CONFIGS: dict[str, dict[str, object]] = {
    "cpu": {"cpu_bytes": _CPU, "disk_read_bps": _SLOW},
    "write-through": {"cpu_bytes": _CPU, "write_through": True, "disk_read_bps": _SLOW},
    "pool": {"cpu_bytes": _CPU, "pool_blocks": 2, "pool_device": "cpu", "disk_read_bps": _SLOW},
    "fast-disk": {"cpu_bytes": _CPU},
    "pool-over-disk": {"cpu_bytes": 0, "pool_blocks": 3, "pool_device": "cpu", "disk_read_bps": _SLOW},
}
# Weighted by repetition. close() comes once, at a drawn point of the first thread, or not.
KINDS = ("store",) * 4 + ("retrieve",) * 3 + ("prefetch",) * 4 + (
    "clear", "lookup", "astore", "aretrieve", "flush", "prefetch_wait", "retrieve_out")
_TOTALS = {"examples": 0, "ops": 0, "blocks_checked": 0, "closed_refusals": 0}
WAIT_S = 30.0


@functools.cache
def _kv(prompt: int, generation: int) -> torch.Tensor:
    return make_kv(PROMPTS[prompt], SMALL_LAYOUT, B, f"generation-{generation}")


class Clears:
    """The oracle's clock: `started`/`done` count clear() calls; stores exclude clears."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._storers = 0
        self._clearing = False
        self.started = self.done = 0
        self.closing = False

    @contextlib.contextmanager
    def storing(self) -> Iterator[int]:
        """Hold off clears; yields the generation whose KV may be stored now."""
        with self._cond:
            self._cond.wait_for(lambda: not self._clearing)
            self._storers += 1
        try:
            yield self.done
        finally:
            with self._cond:
                self._storers -= 1
                self._cond.notify_all()

    def clear(self, store: KVCacheStore) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._clearing)
            self._clearing = True
            self._cond.wait_for(lambda: self._storers == 0)
        try:
            self.started += 1
            store.clear()
            self.done += 1
        finally:
            with self._cond:
                self._clearing = False
                self._cond.notify_all()


def _check_prefix(prompt: int, kv: torch.Tensor | None, num_tokens: int, lo: int, hi: int) -> int:
    """Assert the returned prefix is one generation's bytes, that generation in [lo, hi]."""
    tokens = PROMPTS[prompt]
    assert num_tokens % B == 0 and num_tokens <= len(tokens), num_tokens
    if num_tokens == 0:
        assert kv is None
        return 0
    assert kv is not None and tuple(kv.shape) == SMALL_LAYOUT.block_shape(num_tokens)
    got = kv.contiguous().view(torch.uint8)
    for generation in range(hi, lo - 1, -1):
        if torch.equal(got, _kv(prompt, generation)[:, :, :num_tokens].contiguous().view(torch.uint8)):
            return num_tokens // B
    found = []
    for i in range(num_tokens // B):
        block = got[:, :, i * B : (i + 1) * B]
        found.append(next((g for g in range(hi + 1) if torch.equal(
            block, _kv(prompt, g)[:, :, i * B : (i + 1) * B].contiguous().view(torch.uint8))), None))
    raise AssertionError(f"prompt {prompt}: blocks of generations {found}, expected one generation in "
                         f"[{lo}, {hi}] (None: bytes of no generation)")


class Run:
    """One example: a store, its oracle, and what the threads saw."""

    def __init__(self, store: KVCacheStore) -> None:
        self.store = store
        self.clears = Clears()
        self.futures: list[tuple[int, Future[PrefetchResult]]] = []
        self.errors: list[BaseException] = []
        self.num_ops = self.num_checked = self.num_refused = 0

    def close(self) -> None:
        self.clears.closing = True
        self.store.close()

    def op(self, kind: str, prompt: int) -> None:
        store, clears, tokens = self.store, self.clears, PROMPTS[prompt]
        if kind == "store":
            with clears.storing() as generation:
                n = store.store(tokens, _kv(prompt, generation))
            assert n % B == 0 and n <= len(tokens)
        elif kind in ("retrieve", "retrieve_out", "aretrieve"):
            lo = clears.done
            out = torch.empty(SMALL_LAYOUT.block_shape(len(tokens) + B), dtype=SMALL_LAYOUT.dtype) \
                if kind == "retrieve_out" else None
            res = asyncio.run(store.aretrieve(tokens)) if kind == "aretrieve" else store.retrieve(tokens, out=out)
            self.num_checked += _check_prefix(prompt, res.kv, res.num_tokens, lo, clears.started)
        elif kind == "lookup":
            n = store.lookup(tokens)
            assert n % B == 0 and n <= len(tokens)
        elif kind in ("prefetch", "prefetch_wait"):
            future = store.prefetch(tokens)
            if kind == "prefetch_wait":
                self._check_prefetch(prompt, future)
            else:
                self.futures.append((prompt, future))
        elif kind == "astore":
            asyncio.run(self._astore(prompt))
        elif kind == "clear":
            clears.clear(store)
        elif kind == "flush":
            assert store.flush()
        elif kind == "close":
            self.close()

    async def _astore(self, prompt: int) -> None:
        with self.clears.storing() as generation:  # the call begins (takes its generation) inside
            task = asyncio.ensure_future(self.store.astore(PROMPTS[prompt], _kv(prompt, generation)))
            await asyncio.sleep(0)
        n = await task
        assert n % B == 0 and n <= len(PROMPTS[prompt])

    def _check_prefetch(self, prompt: int, future: Future[PrefetchResult]) -> None:
        result = future.result(WAIT_S)  # never raises, never hangs
        assert isinstance(result, PrefetchResult) and result.status is not PrefetchStatus.FAULT, result
        assert 0 <= result.num_in_memory <= len(PROMPTS[prompt]) // B, result

    def thread(self, program: list[tuple[str, int]], start: threading.Barrier) -> None:
        try:
            start.wait(WAIT_S)
            for kind, prompt in program:
                self.num_ops += 1
                try:
                    self.op(kind, prompt)
                except StoreClosedError:
                    assert self.clears.closing, f"{kind}: StoreClosedError before close()"
                    self.num_refused += 1
        except BaseException as exc:
            self.errors.append(exc)


programs = st.lists(
    st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, len(PROMPTS) - 1)),
             min_size=3, max_size=16),
    min_size=2, max_size=4)


def _run(options: dict[str, object], programs: list[list[tuple[str, int]]], io_threads: int,
         close_at: list[int]) -> None:
    """One example: warm the tiers below memory with generation 0, reopen, run the programs
    (thread i calls close() at step close_at[i])."""
    for program, step in zip(programs, close_at):
        program.insert(step, ("close", 0))
    before = set(threading.enumerate())
    path = tempfile.mkdtemp(prefix="kvstrata-races-")
    options = {"layout": SMALL_LAYOUT, "block_size": B, "disk_bytes": 8 << 20, **options}
    disk = path if options.pop("disk", True) else None
    with open_store(disk, **options) as first:  # slow tiers warm, memory cold: as after a restart
        for prompt, tokens in enumerate(PROMPTS):
            first.store(tokens, _kv(prompt, 0))
    interval = sys.getswitchinterval()
    store = open_store(disk, io_threads=io_threads, **options)
    run = Run(store)
    try:
        sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per run
        start = threading.Barrier(len(programs))
        threads = [threading.Thread(target=run.thread, args=(p, start)) for p in programs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "a call hung"
        if run.errors:
            raise run.errors[0]
        for prompt, future in run.futures:
            run._check_prefetch(prompt, future)
        if not store.closed:  # quiet now: what is cached, and what is stored now, is the latest generation
            store.check_integrity()
            latest = run.clears.done
            for prompt, tokens in enumerate(PROMPTS):
                res = store.retrieve(tokens)
                run.num_checked += _check_prefix(prompt, res.kv, res.num_tokens, latest, latest)
                store.store(tokens, _kv(prompt, latest))  # is never skipped for an older block held
                res = store.retrieve(tokens)
                run.num_checked += _check_prefix(prompt, res.kv, res.num_tokens, latest, latest)
            store.check_integrity()
        run.close()
        assert store.close().num_spilled == 0  # idempotent
        left = [t.name for t in set(threading.enumerate()) - before]
        assert left == [], f"threads left running after close(): {left}"
    finally:
        sys.setswitchinterval(interval)
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    _TOTALS["examples"] += 1
    _TOTALS["ops"] += run.num_ops
    _TOTALS["blocks_checked"] += run.num_checked
    _TOTALS["closed_refusals"] += run.num_refused


_SETTINGS = {"deadline": None, "derandomize": True,
             "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
_ARGS = {"programs": programs, "io_threads": st.integers(1, 3), "close_at": st.lists(st.integers(0, 20), max_size=2)}


@settings(max_examples=BUDGET.count(50), **_SETTINGS)  # type: ignore[arg-type]
@given(config=st.sampled_from(sorted(CONFIGS)), **_ARGS)
def test_background_work_races_clear_and_close(config: str, programs: list[list[tuple[str, int]]],
                                               io_threads: int, close_at: list[int]) -> None:
    _run(CONFIGS[config], programs, io_threads, close_at)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as server:
        yield server.url


@settings(max_examples=BUDGET.count(20), **_SETTINGS)  # type: ignore[arg-type]
@given(namespace=st.uuids(), **_ARGS)
def test_background_work_races_clear_and_close_over_a_remote_tier(
        redis_url: str, namespace: object, programs: list[list[tuple[str, int]]], io_threads: int,
        close_at: list[int]) -> None:
    """CPU tier over a real redis-server (no disk): prefetch reads the remote tier, clear()
    deletes its keys, stores write to it in the background. A namespace per example."""
    _run({"cpu_bytes": _CPU, "disk": False, "remote_url": redis_url, "namespace": f"races-{namespace}"},
         programs, io_threads, close_at)


def test_background_races_checked_real_bytes(figures: Figures) -> None:
    """Runs after the property test (same module): its runs did check returned bytes."""
    assert _TOTALS["examples"] >= 5 and _TOTALS["blocks_checked"] > 0, _TOTALS
    for key, value in _TOTALS.items():
        figures.set(key, value)
