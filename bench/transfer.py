"""Pool <-> CPU block transfers: demotion and promotion against a plain pinned `copy_`.

Run: `kvstrata bench transfer`. On CUDA the pool lives on the GPU and the CPU tier in pinned
memory: demotion is GPU->CPU, promotion CPU->GPU, and the baseline is `copy_` between a
GPU tensor and a pinned host tensor of the same blocks, measured in the same run. Without
CUDA the pool lives in host memory and both directions are host copies (the baseline is
then a host `copy_`). Block sizes 16 KiB to 4 MiB.
"""

from __future__ import annotations

from collections.abc import Callable

import click
import torch

from bench.tiers import SIZES, TOKEN_HEAD_DIM, TOKEN_KV_HEADS
from cli.args import CONTEXT, Choices, invoke, positive
from cli.output import print_table, write_results
from cli.progress import tqdm
from engine_adapter.runner.block_manager import KVCacheManager
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.shared.blockcopy import copy_block


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], repeat: int) -> float:
    import time

    best = float("inf")
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_size(label: str, mib: int, repeat: int) -> dict[str, float]:
    block_size, layers = SIZES[label]
    layout = KVLayout(layers, TOKEN_KV_HEADS, TOKEN_HEAD_DIM, torch.bfloat16)
    block_bytes = layout.block_bytes(block_size)
    n = max(8, (mib << 20) // block_bytes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = StoreConfig(layout, block_size=block_size, pool_blocks=n + 1, pool_device=device,
                      cpu_bytes=(n + 1) * block_bytes)
    store = KVCacheStore(cfg)
    pool = store.pool
    assert pool is not None
    nbytes = n * block_bytes
    tokens = list(range(n * block_size))
    kv = torch.randn(layout.block_shape(len(tokens)), device=device).to(layout.dtype)
    store.store(tokens, kv)  # n cached pool blocks

    t_demote = _time(lambda: pool.spill(), 1)  # GPU->CPU, every block (first copy of each; CPU slab pre-faulted)
    mgr = KVCacheManager(store)

    def promote() -> None:  # CPU->GPU: drop pool copies, load every block back through the manager
        pool.clear()
        mgr.add_request("p", [*tokens, 0])
        comp = mgr.get_computed_blocks("p")
        mgr.allocate_slots("p", 1, comp)
        mgr.free("p")

    t_promote = _time(promote, repeat)
    # Baseline: the same blocks copied between the pool tensor and a (pinned) host buffer: a
    # plain copy_ on CUDA; on CPU the single-threaded memcpy of copy_block (torch's OpenMP
    # copy_ stalls on a busy machine and would flatter the tier). Pages faulted in first.
    host = torch.zeros((n, *layout.block_shape(block_size)), dtype=layout.dtype, pin_memory=device == "cuda")
    copy = (lambda d, s: d.copy_(s)) if device == "cuda" else copy_block
    t_d2h = _time(lambda: [copy(host[i], pool.block_view(i)) for i in range(n)], repeat)
    t_h2d = _time(lambda: [copy(pool.block_view(i), host[i]) for i in range(n)], repeat)
    # The link's limit: one copy_ of all the bytes between contiguous buffers.
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_flat = host.view(-1).view(torch.uint8)
    t_bulk_d2h = _time(lambda: host_flat.copy_(flat), repeat)
    t_bulk_h2d = _time(lambda: flat.copy_(host_flat), repeat)
    store.close()
    return {"block_bytes": block_bytes, "num_blocks": n, "device": device,
            "demote_gbps": nbytes / t_demote / 1e9, "promote_gbps": nbytes / t_promote / 1e9,
            "copy_d2h_gbps": nbytes / t_d2h / 1e9, "copy_h2d_gbps": nbytes / t_h2d / 1e9,
            "bulk_d2h_gbps": nbytes / t_bulk_d2h / 1e9, "bulk_h2d_gbps": nbytes / t_bulk_h2d / 1e9}


def run(mib: int = 64, sizes: list[str] | None = None, repeat: int = 3) -> dict[str, object]:
    results = {label: bench_size(label, mib, repeat) for label in tqdm(sizes or list(SIZES), desc="block sizes",
                                                                      disable=None)}
    rows = []
    for label, r in results.items():
        r["demote_ratio"] = r["demote_gbps"] / r["copy_d2h_gbps"]
        r["promote_ratio"] = r["promote_gbps"] / r["copy_h2d_gbps"]
        r["demote_bulk_ratio"] = r["demote_gbps"] / r["bulk_d2h_gbps"]
        r["promote_bulk_ratio"] = r["promote_gbps"] / r["bulk_h2d_gbps"]
        rows.append([label, r["device"], "demote pool->CPU", r["demote_gbps"], r["copy_d2h_gbps"], r["demote_ratio"],
                     r["bulk_d2h_gbps"], r["demote_bulk_ratio"]])
        rows.append([label, r["device"], "promote CPU->pool", r["promote_gbps"], r["copy_h2d_gbps"],
                     r["promote_ratio"], r["bulk_h2d_gbps"], r["promote_bulk_ratio"]])
    print_table(f"Pool <-> CPU transfers, ~{mib} MiB per block size (best of {repeat}); baseline: copy_ of the "
                "same blocks one by one; bulk: one copy_ of all the bytes, contiguous",
                ["block", "pool on", "direction", "GB/s", "baseline GB/s", "ratio", "bulk GB/s", "ratio to bulk"],
                rows)
    return {"mib": mib, "sizes": results}


@click.command("transfer", help=__doc__, context_settings=CONTEXT)
@click.option("--mib", type=positive(), default=64, show_default=True)
@click.option("--sizes", type=Choices(list(SIZES), str.upper), default=",".join(SIZES), show_default=True,
              help="block sizes to measure")
@click.option("--repeat", type=positive(), default=3, show_default=True)
def command(mib: int, sizes: list[str], repeat: int) -> None:
    write_results("transfer", run(mib, sizes, repeat))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench transfer")
