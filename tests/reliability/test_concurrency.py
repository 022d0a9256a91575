"""Concurrency: many threads on one store, and several processes on one disk directory.

Threads store, retrieve and look up overlapping prefixes (shared roots) at once; processes
share one LMDB directory (LMDB allows one writer at a time; readers never wait for it). No
call may hang, every block returned must be bit-exact, nothing committed may be lost while
there is room for it, and the tiers' invariants must hold afterwards.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import KVCacheStore

from . import procs
from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, PromptPool, check_kv, full_blocks, make_kv, open_store
from .workers import disk_tier, shared_dir_worker

MODES = {
    # 48 CPU slots over a 1 MiB disk tier: demotion, promotion and disk eviction all the time.
    "evicting": {"cpu_bytes": 48 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 1 << 20},
    # Room for everything: every committed prompt must still be whole at the end.
    "roomy": {"cpu_bytes": 4096 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 64 << 20},
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
