"""Pool demotion policy: copy-on-evict against write-through, on one request stream.

Run: `kvstrata bench demotion [--requests N]`. A multi-round chat workload (sessions whose
prompts extend their previous turn) runs through `KVCacheManager` on a pool smaller than
the working set, over a CPU tier. For each policy: bytes copied pool->CPU, the time the
allocation path spends (where eviction happens), the time spent caching blocks (where
write-through copies), total time, and the hit rate. The baseline for copy cost is a plain
`copy_` of the same number of blocks, measured in the same run.
"""

from __future__ import annotations

import random
import time

import click
import torch

from bench.common import timeit
from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results
from engine_adapter.runner.block_manager import KVCacheManager
from kvstore import KVCacheStore, KVLayout, StoreConfig


def _workload(num_requests: int, block_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    sessions: list[list[int]] = [[rng.randrange(32000) for _ in range(block_size * 8)] for _ in range(12)]
    out = []
    for _ in range(num_requests):
        s = rng.randrange(len(sessions))
        sessions[s] = sessions[s] + [rng.randrange(32000) for _ in range(block_size * rng.randrange(1, 6) + 3)]
        out.append(list(sessions[s]))
    return out


def run_policy(policy: str, prompts: list[list[int]], layout: KVLayout, block_size: int,
               pool_blocks: int, cpu_blocks: int) -> dict[str, float]:
    cfg = StoreConfig(layout, block_size=block_size, pool_blocks=pool_blocks, pool_device=None,
                      cpu_bytes=cpu_blocks * layout.block_bytes(block_size), pool_demotion=policy)
    store = KVCacheStore(cfg)
    pool = store.pool
    assert pool is not None
    mgr = KVCacheManager(store)
    t_alloc = t_commit = 0.0
    hit = total = 0
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        mgr.add_request(rid, prompt)
        comp = mgr.get_computed_blocks(rid)
        t = time.perf_counter()
        alloc = mgr.allocate_slots(rid, len(prompt) - comp.num_tokens, comp)
        t_alloc += time.perf_counter() - t
        hit += alloc.num_computed_tokens
        total += len(prompt)
        table = mgr.block_table(rid)
        for b in table[alloc.num_computed_tokens // block_size :]:  # "compute": write fresh KV
            pool.block_view(b).fill_(float(i % 7))
        t = time.perf_counter()
        mgr.commit(rid, len(prompt))
        t_commit += time.perf_counter() - t
        mgr.free(rid)
    elapsed = time.perf_counter() - t0
    block_bytes = layout.block_bytes(block_size)
    out = {
        "bytes_demoted": pool.num_demoted * block_bytes, "blocks_demoted": pool.num_demoted,
        "alloc_s": t_alloc, "commit_s": t_commit, "total_s": elapsed, "hit_rate": hit / total,
    }
    store.close()
    return out


def run(num_requests: int = 200, block_size: int = 16, layers: int = 8) -> dict[str, object]:
    layout = KVLayout(layers, 8, 128, torch.bfloat16)
    prompts = _workload(num_requests, block_size)
    pool_blocks = 256
    cpu_blocks = 2048
    results = {p: run_policy(p, prompts, layout, block_size, pool_blocks, cpu_blocks)
               for p in ("on_evict", "write_through")}
    # Baseline: plain copy_ of distinct blocks from a pool-sized tensor into a slab-sized one
    # (cold memory, like real demotions), per block.
    # On CUDA: the pool on the GPU, the slab pinned (what the CPU tier allocates).
    cuda = torch.cuda.is_available()
    src = torch.ones((pool_blocks, *layout.block_shape(block_size)), dtype=layout.dtype,
                     device="cuda" if cuda else "cpu")
    dst = torch.zeros((cpu_blocks, *layout.block_shape(block_size)), dtype=layout.dtype, pin_memory=cuda)
    n = min(cpu_blocks, 1024)

    def copies() -> None:
        for i in range(n):
            dst[(7 * i) % cpu_blocks].copy_(src[i % pool_blocks])
        if cuda:
            torch.cuda.synchronize()

    per_block = timeit(copies, repeat=3) / n

    rows = []
    for p, r in results.items():
        copy_floor = r["blocks_demoted"] * per_block
        r["copy_floor_s"] = copy_floor
        r["demotion_path_over_floor"] = (r["alloc_s"] + r["commit_s"]) / copy_floor if copy_floor else 0.0
        rows.append([p, r["blocks_demoted"], r["bytes_demoted"] / 2**20, r["alloc_s"] * 1e3, r["commit_s"] * 1e3,
                     r["total_s"] * 1e3, copy_floor * 1e3, r["demotion_path_over_floor"], r["hit_rate"]])
    print_table(f"Pool demotion policy: {num_requests} multi-round chat requests, pool {pool_blocks} blocks "
                f"of {layout.block_bytes(block_size) >> 10} KiB, CPU tier {cpu_blocks} blocks",
                ["policy", "blocks demoted", "MiB copied", "alloc ms", "commit ms", "total ms",
                 "copy_ floor ms", "(alloc+commit)/floor", "hit rate"], rows)
    return {"layout": str(layout), "pool_blocks": pool_blocks, "cpu_blocks": cpu_blocks,
            "copy_per_block_s": per_block, "policies": results}


@click.command("demotion", help=__doc__, context_settings=CONTEXT)
@click.option("--requests", type=positive(), default=200, show_default=True)
@click.option("--layers", type=click.IntRange(1, 512), default=8, show_default=True)
def command(requests: int, layers: int) -> None:
    write_results("demotion", run(requests, layers=layers))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench demotion")
