"""`kvstrata bench scale`: how lookup, store and index memory grow with the cached blocks.

For N cached blocks from 10^3 to 10^6 (pool and CPU tiers; the disk tier to `--max-disk`),
fill a store with N blocks of tiny KV (the index is what is measured, not the copies),
then time `store` per block (the fill), `lookup` per block of a 32K-token prompt at 100%
and 0% hit, and the Python index memory per block (tracemalloc, in a separate fill; for the
disk tier that is its in-memory copy of the hashes, while the full entries live in its LMDB
index). The reference is the ~250 bytes of metadata per block that vLLM's design quotes.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
import tracemalloc

import click
import numpy as np
import torch

from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results
from cli.progress import tqdm
from kvstore import KVCacheStore, KVLayout, StoreConfig

LAYOUT = KVLayout(1, 1, 1, torch.float16)
BLOCK = 16
BATCH_BLOCKS = 2048  # one store() call = a 32K-token prompt
VLLM_BYTES_PER_BLOCK = 250


def _config(tier: str, n: int, path: str) -> StoreConfig:
    bb = LAYOUT.block_bytes(BLOCK)
    if tier == "pool":
        return StoreConfig(LAYOUT, block_size=BLOCK, pool_blocks=n + BATCH_BLOCKS, pool_device="cpu", cpu_bytes=0)
    if tier == "cpu":
        return StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=(n + BATCH_BLOCKS) * bb)
    return StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, disk_path=path, disk_bytes=(n + BATCH_BLOCKS) * 8192 * 2,
                       disk_sync=False)


def _fill(store: KVCacheStore, n: int, rng: np.random.Generator) -> tuple[float, list[int]]:
    kv = torch.zeros(LAYOUT.block_shape(BATCH_BLOCKS * BLOCK), dtype=LAYOUT.dtype)
    t_store = 0.0
    last: list[int] = []
    done = 0
    while done < n:
        k = (n - done) % BATCH_BLOCKS or BATCH_BLOCKS  # the short prompt first: the last, which lookups time, is whole
        last = rng.integers(0, 2**31, size=k * BLOCK).tolist()
        t0 = time.perf_counter()
        store.store(last, kv[:, :, : k * BLOCK])
        t_store += time.perf_counter() - t0
        done += k
    return t_store, last


def measure(tier: str, n: int, repeat: int = 5) -> dict[str, float]:
    rng = np.random.default_rng(n)
    tmp = tempfile.mkdtemp(prefix="kvstrata-scale-")
    try:
        with KVCacheStore(_config(tier, n, tmp)) as store:
            t_store, last = _fill(store, n, rng)
            assert store.lookup(last) == len(last)
            miss = rng.integers(0, 2**31, size=len(last)).tolist()
            nb = len(last) // BLOCK

            def per_block(tokens: list[int]) -> float:
                t0 = time.perf_counter()
                for _ in range(repeat):
                    store.lookup(tokens)
                return (time.perf_counter() - t0) / repeat / nb * 1e9

            hit_ns, miss_ns = per_block(last), per_block(miss)
        shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        with KVCacheStore(_config(tier, n, tmp)) as store:
            _fill(store, n, np.random.default_rng(n))
            gc.collect()
            after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        mem = sum(s.size_diff for s in after.compare_to(before, "filename")) / n
        return {"blocks": n, "store_ns_per_block": t_store / n * 1e9, "lookup_hit_ns_per_block": hit_ns,
                "lookup_miss_ns_per_block": miss_ns, "index_bytes_per_block": mem}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(max_blocks: int = 10**6, max_disk: int = 10**5) -> dict[str, object]:
    counts = [n for n in (10**3, 10**4, 10**5, 10**6) if n <= max_blocks]
    jobs = [(t, n) for t in ("pool", "cpu", "disk") for n in counts if t != "disk" or n <= max_disk]
    results = {f"{t}/{n}": measure(t, n) for t, n in tqdm(jobs, desc="scale", disable=None)}
    rows = []
    for key, r in results.items():
        tier = key.split("/")[0]
        mem = r["index_bytes_per_block"]
        rows.append([tier, r["blocks"], r["store_ns_per_block"], r["lookup_hit_ns_per_block"],
                     r["lookup_miss_ns_per_block"], mem, mem / VLLM_BYTES_PER_BLOCK])
    print_table("Scaling with cached blocks (16-token blocks, tiny KV: index cost only)",
                ["tier", "blocks", "store ns/blk", "lookup hit ns/blk", "lookup miss ns/blk", "index B/blk",
                 "vs vLLM 250 B"], rows)
    return {"vllm_bytes_per_block": VLLM_BYTES_PER_BLOCK, "results": results}


@click.command("scale", help=__doc__, context_settings=CONTEXT)
@click.option("--max-blocks", type=click.IntRange(min=1000), default=10**6, show_default=True)
@click.option("--max-disk", type=click.IntRange(min=1000), default=10**5, show_default=True)
def command(max_blocks: int, max_disk: int) -> None:
    write_results("scale", run(max_blocks, max_disk))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench scale")
