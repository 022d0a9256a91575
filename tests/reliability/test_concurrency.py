"""Concurrency: many threads on one store, and several processes on one disk directory.

Threads store, retrieve and look up overlapping prefixes (shared roots) at once; processes
share one LMDB directory (LMDB allows one writer at a time; readers never wait for it). No
call may hang, every block returned must be bit-exact, nothing committed may be lost while
there is room for it, and the tiers' invariants must hold afterwards.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine_adapter.runner.block_manager import KVCacheManager
from kvstore import KVCacheStore
from tests.conftest import POOL_DEVICE

from . import procs
from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, PromptPool, check_kv, full_blocks, make_kv, open_store
from .runnerkv import serve
from .workers import disk_tier, shared_dir_worker

MODES = {
    # 48 CPU slots over a 1 MiB disk tier: demotion, promotion and disk eviction all the time.
    "evicting": {"cpu_bytes": 48 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 1 << 20},
    # Room for everything: every committed prompt must still be whole at the end.
    "roomy": {"cpu_bytes": 4096 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 64 << 20},
    # A 32-block pool in front of the evicting stack: pool -> CPU -> disk demotion, both policies.
    "pool-on-evict": {"pool_blocks": 32, "pool_device": "cpu", "pool_demotion": "on_evict",
                      "cpu_bytes": 48 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 1 << 20},
    "pool-write-through": {"pool_blocks": 32, "pool_device": "cpu", "pool_demotion": "write_through",
                           "cpu_bytes": 48 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 1 << 20},
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_threads_on_one_store(tmp_path: Path, mode: str, figures: Figures) -> None:
    pool = PromptPool(BUDGET.seed, 256, num_roots=8)
    store = open_store(str(tmp_path), **MODES[mode])
    errors: list[BaseException] = []
    stored: set[int] = set()
    counts = {"store": 0, "retrieve": 0, "lookup": 0, "blocks_verified": 0}
    counts_lock = threading.Lock()
    start = threading.Barrier(BUDGET.num_threads)

    def run(thread_index: int) -> None:
        rng = np.random.default_rng([BUDGET.seed, 40, thread_index])
        mine = {"store": 0, "retrieve": 0, "lookup": 0, "blocks_verified": 0}
        try:
            start.wait()
            for _ in range(BUDGET.ops_per_thread):
                j = int(rng.integers(pool.num_prompts))
                tokens = pool.prompt(j)
                op = rng.random()
                if op < 0.4:
                    store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
                    with counts_lock:
                        stored.add(j)
                    mine["store"] += 1
                elif op < 0.8:
                    res = store.retrieve(tokens)
                    got = check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
                    mine["blocks_verified"] += got
                    mine["retrieve"] += 1
                else:
                    n = store.lookup(tokens)
                    assert n % BLOCK == 0 and n <= len(tokens)
                    mine["lookup"] += 1
        except BaseException as exc:
            errors.append(exc)
        with counts_lock:
            for key, value in mine.items():
                counts[key] += value

    threads = [threading.Thread(target=run, args=(i,)) for i in range(BUDGET.num_threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    elapsed = time.perf_counter() - t0
    try:
        if errors:
            raise errors[0]
        store.check_integrity()
        assert disk_tier(store).scrub().num_corrupt == 0
        num_whole = 0
        if mode == "roomy":
            for j in sorted(stored):
                tokens = pool.prompt(j)
                res = store.retrieve(tokens)
                check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
                assert res.num_tokens == full_blocks(tokens), f"committed prompt {j} lost blocks"
                num_whole += 1
        num_ops = counts["store"] + counts["retrieve"] + counts["lookup"]
        assert num_ops == BUDGET.num_threads * BUDGET.ops_per_thread
        figures.set("threads", BUDGET.num_threads)
        figures.set("ops", num_ops)
        figures.set("mismatches", 0)
        figures.set("blocks_verified", counts["blocks_verified"])
        figures.set("committed_prompts_whole", num_whole)
        figures.set("ops_per_s", round(num_ops / elapsed))
    finally:
        store.close()


@pytest.mark.slow
def test_processes_share_one_disk_directory(tmp_path: Path, figures: Figures) -> None:
    """Writers and readers in separate processes on one LMDB directory, started together."""
    disk = tmp_path / "disk"
    ctx = procs.context()
    specs = []
    for i in range(BUDGET.num_processes):
        specs.append({
            "disk_path": str(disk), "seed": BUDGET.seed, "index": i,
            "writer": i % 2 == 0, "with_cpu": i % 4 == 0,
            "seconds": BUDGET.process_seconds, "start_at": time.time() + 0.5,
            "journal": str(tmp_path / f"journal{i}"), "report": str(tmp_path / f"report{i}.json"),
        })
    children = [ctx.Process(target=shared_dir_worker, args=(s,)) for s in specs]
    for c in children:
        c.start()
    for c in children:
        c.join(timeout=BUDGET.process_seconds + 120)
    for c, s in zip(children, specs, strict=True):
        assert c.exitcode == 0, procs.error_of(s["report"])
    reports = [procs.read_json(s["report"]) for s in specs]
    assert all(r["ops"] > 0 for r in reports)
    # A fresh opener finds everything any process committed, whole and exact.
    pool = PromptPool(BUDGET.seed, 512, num_roots=8)
    committed = set()
    for s in specs:
        if s["writer"]:
            committed |= {int(x) for x in Path(s["journal"]).read_text().split()}
    store: KVCacheStore = open_store(str(disk))
    try:
        num_blocks = 0
        for j in sorted(committed):
            tokens = pool.prompt(j)
            res = store.retrieve(tokens)
            num_blocks += check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
            assert res.num_tokens == full_blocks(tokens), f"committed prompt {j} lost blocks"
        store.check_integrity()
        assert disk_tier(store).scrub().num_corrupt == 0
    finally:
        store.close()
    figures.set("processes", len(specs))
    figures.set("ops", sum(r["ops"] for r in reports))
    figures.set("blocks_verified", sum(r["blocks_verified"] for r in reports) + num_blocks)
    figures.set("committed_prompts_whole", len(committed))
    figures.set("max_read_latency_ms", round(max(r["max_read_ms"] for r in reports), 1))
    figures.set("mismatches", 0)


@pytest.mark.slow
@pytest.mark.parametrize("demotion", ["on_evict", "write_through"])
def test_manager_requests_beside_store_calls(tmp_path: Path, demotion: str, figures: Figures) -> None:
    """Threads serving requests through one `KVCacheManager` (reusing cached prefixes, loading
    CPU/disk hits into the pool, computing, committing, decoding, freeing) while other threads
    store, retrieve and look up the same prefixes on the same store. A small pool evicts all
    the time. No request may ever see a reused block holding the wrong KV, nor have a block it
    holds changed under it; `store()`/`retrieve()` stay bit-exact; integrity clean after."""
    store = open_store(str(tmp_path), pool_blocks=64, pool_device=POOL_DEVICE, pool_demotion=demotion,
                       cpu_bytes=48 * LAYOUT.block_bytes(BLOCK), disk_bytes=1 << 20)
    mgr = KVCacheManager(store)
    pool = PromptPool(BUDGET.seed, 192, num_roots=6)
    num_threads = BUDGET.num_threads
    errors: list[BaseException] = []
    counts = {"requests": 0, "no_room": 0, "reused_tokens": 0, "pool_blocks_checked": 0,
              "store": 0, "retrieve": 0, "lookup": 0, "blocks_verified": 0}
    counts_lock = threading.Lock()
    start = threading.Barrier(num_threads)

    def run(thread_index: int) -> None:
        rng = np.random.default_rng([BUDGET.seed, 42, thread_index])
        mine = dict.fromkeys(counts, 0)
        try:
            start.wait()
            for k in range(BUDGET.ops_per_thread // 2):
                tokens = pool.prompt(int(rng.integers(pool.num_prompts)))
                if thread_index % 2 == 0:  # a runner thread
                    if len(tokens) == 0:
                        continue
                    got = serve(mgr, f"t{thread_index}-{k}", tokens, LAYOUT, BLOCK,
                                num_decode=int(rng.integers(0, 3)), between=lambda: time.sleep(0))
                    if got is None:
                        mine["no_room"] += 1
                    else:
                        mine["requests"] += 1
                        mine["reused_tokens"] += got[0]
                        mine["pool_blocks_checked"] += got[1]
                    continue
                op = rng.random()
                if op < 0.4:
                    store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
                    mine["store"] += 1
                elif op < 0.85:
                    res = store.retrieve(tokens)
                    mine["blocks_verified"] += check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
                    mine["retrieve"] += 1
                else:
                    n = store.lookup(tokens)
                    assert n % BLOCK == 0 and n <= len(tokens)
                    mine["lookup"] += 1
        except BaseException as exc:
            errors.append(exc)
        with counts_lock:
            for key, value in mine.items():
                counts[key] += value

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per operation
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(old_interval)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    try:
        if errors:
            raise errors[0]
        assert not mgr.request_ids(), "a request outlived its free()"
        store.check_integrity()
        assert store.pool is not None and len(store.pool.free_queue) == store.pool.num_blocks
        assert disk_tier(store).scrub().num_corrupt == 0
        assert counts["requests"] > 0 and counts["reused_tokens"] > 0
        for key, value in counts.items():
            figures.set(key, value)
        figures.set("threads", num_threads)
        figures.set("mismatches", 0)
    finally:
        store.close()


def test_duplicate_request_ids_race(figures: Figures) -> None:
    """Regression: threads adding the same request id at once could all succeed (check, hash,
    then insert, unlocked); the later add replaced the earlier request, whose blocks were then
    never freed. Exactly one add per id may win, and the pool must be whole afterwards."""
    from kvstore import InvalidInputError

    from .kvgen import SMALL_BLOCK, SMALL_LAYOUT

    store = open_store(None, layout=SMALL_LAYOUT, block_size=SMALL_BLOCK, pool_blocks=64,
                       pool_device=POOL_DEVICE, cpu_bytes=0)
    mgr = KVCacheManager(store)
    tokens = np.arange(64 * SMALL_BLOCK + 1, dtype=np.uint32)
    num_rounds = BUDGET.count(100)
    barrier = threading.Barrier(4)
    wins: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for r in range(num_rounds):
                barrier.wait()
                try:
                    mgr.add_request(f"x{r}", tokens)
                    won = True
                except InvalidInputError:
                    won = False
                if won:
                    wins.append(r)
                    mgr.allocate_slots(f"x{r}", 2 * SMALL_BLOCK)
                barrier.wait()  # everyone has tried; the winner frees
                if won:
                    mgr.free(f"x{r}")
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(old_interval)
    try:
        assert not any(t.is_alive() for t in threads), "a thread is stuck"
        if errors and not isinstance(errors[0], threading.BrokenBarrierError):
            raise errors[0]
        assert sorted(wins) == list(range(num_rounds)), "an id was added twice, or never"
        assert store.pool is not None and len(store.pool.free_queue) == store.pool.num_blocks
        store.check_integrity()
        figures.set("rounds", num_rounds)
        figures.set("double_adds", 0)
    finally:
        store.close()
