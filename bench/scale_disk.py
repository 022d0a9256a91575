"""`kvstrata bench scale-disk`: the disk tier's costs as it grows to 10^7 blocks.

For N blocks (default 10^5, 10^6, 10^7) of tiny KV (the 16-token tiny layout of `bench scale`:
the index is what is measured), fill a disk tier of exactly N blocks, then measure per block:
`store` (the fill), `lookup` of a 2,048-block prompt at 100% and 0% hit (the fastest of 20),
and `store` past capacity (every block stored evicts one), each as wall and as this
process's CPU time (the machine may be shared: CPU time is what other load changes least).
Then a new process opens the filled directory, as after a restart: the open's wall time,
its anonymous RSS growth (the in-memory index), and,
in a second process, what tracemalloc sees the open allocate. The LMDB file's bytes on disk
are divided by N too. Baselines from the same run: a raw LMDB cursor pass over the same keys
in the opening process (the floor of reading the index), the 16 bytes of a block hash, and
the smallest N (per-block costs should stay flat: the ratios are against it). One size with
real payloads (`--payload-mib`, default 2 MiB blocks at `--payload-blocks`) shows the I/O side,
against the same bytes written to a plain file first (no sync on either).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import click
import numpy as np
import torch

from bench.scale import BATCH_BLOCKS, BLOCK, LAYOUT
from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.disk.tier import bytes_per_block

GOAL_OPEN_S_PER_MILLION = 1.0
GOAL_INDEX_BYTES = 100


def _layout(payload_mib: float) -> KVLayout:
    if payload_mib <= 0:
        return LAYOUT
    # 2 x layers x 16 tokens x 8 heads x 128 x 2 bytes = 64 KiB per layer
    return KVLayout(max(1, round(payload_mib * 16)), 8, 128, torch.float16)


def config(path: str, n: int, payload_mib: float) -> StoreConfig:
    """A disk-only store on `path` whose budget holds exactly `n` blocks."""
    layout = _layout(payload_mib)
    cost = bytes_per_block(layout.block_bytes(BLOCK))
    return StoreConfig(layout, block_size=BLOCK, cpu_bytes=0, disk_path=path, disk_bytes=max(n, 2) * cost,
                       disk_sync=False)


def _batches(n: int, payload_mib: float) -> int:
    return BATCH_BLOCKS if payload_mib <= 0 else max(1, int(64 // payload_mib))


def _store(store: KVCacheStore, n: int, batch: int, kv: torch.Tensor, rng: np.random.Generator
           ) -> tuple[float, float, list[int]]:
    """Store `n` new blocks in prompts of `batch` blocks, the short one (`n % batch`) first so
    that the last, which lookups time, is whole at any `n`; the wall and CPU seconds spent in
    store() and the last prompt."""
    spent, cpu, last, done = 0.0, 0.0, [], 0
    while done < n:
        k = (n - done) % batch or batch
        last = rng.integers(0, 2**31, size=k * BLOCK).tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        store.store(last, kv[:, :, : k * BLOCK])
        spent, cpu = spent + time.perf_counter() - t0, cpu + time.process_time() - c0
        done += k
    return spent, cpu, last


def _raw_write(path: str, n: int, batch: int, kv: torch.Tensor) -> tuple[float, float]:
    """The baseline of a real-payload size: the same bytes written to one plain file in
    pieces of `batch` blocks (no sync, like the tier here); wall and CPU seconds."""
    view = kv.view(torch.uint8).reshape(-1).numpy()
    per_block = view.nbytes // batch
    fd = os.open(os.path.join(path, "raw.bin"), os.O_WRONLY | os.O_CREAT)
    try:
        t0, c0, done = time.perf_counter(), time.process_time(), 0
        while done < n:
            k = min(batch, n - done)
            os.pwrite(fd, view[: k * per_block], done * per_block)
            done += k
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        os.close(fd)
        os.unlink(os.path.join(path, "raw.bin"))


def _child_open(path: str, n: int, payload_mib: float, traced: bool) -> dict[str, float]:
    """In a fresh process: open the filled directory; time, RSS growth, optionally tracemalloc."""
    code = ("import json,sys; from bench.scale_disk import open_in_child as f; "
            "print(json.dumps(f(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == '1')))")
    out = subprocess.run([sys.executable, "-c", code, path, str(n), str(payload_mib), "1" if traced else "0"],
                         check=True, capture_output=True, text=True, timeout=3600)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def open_in_child(path: str, n: int, payload_mib: float, traced: bool) -> dict[str, float]:
    """Run in the new process: the raw cursor pass, then the store's open and what it holds."""
    import gc
    import tracemalloc

    import lmdb

    env = lmdb.open(path, readonly=True, lock=False, max_dbs=16, subdir=True)
    t0 = time.perf_counter()
    with env.begin(db=env.open_db(b"index", create=False)) as txn:
        raw_keys = sum(1 for _ in txn.cursor().iternext(values=False))
    raw_s = time.perf_counter() - t0
    env.close()
    gc.collect()
    if traced:
        tracemalloc.start()
    rss0 = _rss_anon()
    t0, c0 = time.perf_counter(), time.process_time()
    store = KVCacheStore(config(path, n, payload_mib))
    open_s, open_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    gc.collect()
    result = {"open_s": open_s, "open_cpu_s": open_cpu_s, "raw_cursor_s": raw_s, "raw_keys": raw_keys,
              "rss_bytes": _rss_anon() - rss0}
    if traced:
        result["traced_bytes"] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    store.close()
    return result


def _disk_bytes(path: str) -> tuple[int, int]:
    st = os.stat(os.path.join(path, "data.mdb"))
    slots = sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path) if f.endswith(".kvd"))
    return st.st_blocks * 512, slots


def measure(n: int, payload_mib: float = 0.0, evict_blocks: int | None = None, repeat: int = 20,
            root: str | None = None) -> dict[str, float]:
    """Fill a tier of `n` blocks, time lookups and evicting stores, then open it in new processes."""
    rng = np.random.default_rng(n)
    layout = _layout(payload_mib)
    batch = _batches(n, payload_mib)
    kv = torch.zeros(layout.block_shape(batch * BLOCK), dtype=layout.dtype)
    tmp = tempfile.mkdtemp(prefix="kvstrata-scale-disk-", dir=root)
    try:
        raw = _raw_write(tmp, n, batch, kv) if payload_mib > 0 else None
        with KVCacheStore(config(tmp, n, payload_mib)) as store:
            store_s, store_cpu, last = _store(store, n, batch, kv, rng)
            nb = len(last) // BLOCK
            assert store.lookup(last) == len(last), "the last prompt stored is not held"
            miss = rng.integers(0, 2**31, size=len(last)).tolist()

            def per_block(tokens: list[int]) -> tuple[float, float]:
                """The fastest of `repeat` lookups, wall and CPU ns per block (the least
                disturbed by other load on a shared machine)."""
                wall, cpu = float("inf"), float("inf")
                for _ in range(repeat):
                    t0, c0 = time.perf_counter(), time.process_time()
                    store.lookup(tokens)
                    wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
                return wall / nb * 1e9, cpu / nb * 1e9

            (hit_ns, hit_cpu), (miss_ns, _) = per_block(last), per_block(miss)
            ne = evict_blocks if evict_blocks is not None else min(n, 10 * batch)
            evict_s, evict_cpu, newest = _store(store, ne, batch, kv, rng)
            held = store.lookup(newest) == len(newest)
        mdb_bytes, slot_bytes = _disk_bytes(tmp)
        opened = _child_open(tmp, n, payload_mib, traced=False)
        traced = _child_open(tmp, n, payload_mib, traced=True)
        figures = {} if raw is None else {
            "raw_write_gbps": n * layout.block_bytes(BLOCK) / raw[0] / 1e9, "raw_write_cpu_s": raw[1],
            "store_vs_raw_write": raw[0] / store_s}
        return figures | {
            "blocks": n, "block_bytes": layout.block_bytes(BLOCK),
            "store_ns_per_block": store_s / n * 1e9, "store_gbps": n * layout.block_bytes(BLOCK) / store_s / 1e9,
            "lookup_hit_ns_per_block": hit_ns, "lookup_miss_ns_per_block": miss_ns, "lookup_blocks": nb,
            "evict_store_ns_per_block": evict_s / ne * 1e9, "evicted_blocks": ne,
            "store_cpu_ns_per_block": store_cpu / n * 1e9, "lookup_hit_cpu_ns_per_block": hit_cpu,
            "evict_store_cpu_ns_per_block": evict_cpu / ne * 1e9,
            "newest_prompt_held_after_evicting": held,
            "open_s": opened["open_s"], "open_s_per_million": opened["open_s"] / n * 1e6,
            "open_cpu_s": opened["open_cpu_s"], "open_cpu_s_per_million": opened["open_cpu_s"] / n * 1e6,
            "raw_cursor_s": opened["raw_cursor_s"], "open_vs_raw_cursor": opened["open_s"] / opened["raw_cursor_s"],
            "raw_keys": opened["raw_keys"],
            "rss_bytes_per_block": opened["rss_bytes"] / n, "traced_bytes_per_block": traced["traced_bytes"] / n,
            "traced_open_s": traced["open_s"],
            "lmdb_bytes_per_block": mdb_bytes / n, "slot_bytes_per_block": slot_bytes / n,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(counts: list[int], payload_mib: float, payload_blocks: int, root: str | None = None) -> dict[str, object]:
    results: dict[str, dict[str, float]] = {}
    for n in counts:
        results[f"tiny/{n}"] = measure(n, root=root)
        print(f"  tiny/{n}: {json.dumps(results[f'tiny/{n}'])}", flush=True)
        write_results("scale_disk", {"partial": True, "results": results})  # a long run keeps what it has
    if payload_blocks > 0:
        results[f"{payload_mib:g}MiB/{payload_blocks}"] = measure(payload_blocks, payload_mib, root=root)
    base = results[f"tiny/{min(counts)}"]
    for key, r in results.items():
        if key.startswith("tiny/"):
            for name in ("store_ns_per_block", "lookup_hit_ns_per_block", "evict_store_ns_per_block",
                         "store_cpu_ns_per_block", "lookup_hit_cpu_ns_per_block", "evict_store_cpu_ns_per_block",
                         "open_s_per_million", "open_cpu_s_per_million", "rss_bytes_per_block"):
                r[f"{name}_vs_smallest"] = r[name] / base[name]
        r["goal_open_met"] = r["open_s_per_million"] < GOAL_OPEN_S_PER_MILLION
        r["goal_open_cpu_met"] = r["open_cpu_s_per_million"] < GOAL_OPEN_S_PER_MILLION
        r["goal_index_bytes_met"] = max(r["rss_bytes_per_block"], r["traced_bytes_per_block"]) < GOAL_INDEX_BYTES
    rows = [[k, r["store_ns_per_block"], r["store_cpu_ns_per_block"], r["lookup_hit_ns_per_block"],
             r["lookup_hit_cpu_ns_per_block"], r["lookup_miss_ns_per_block"], r["evict_store_ns_per_block"],
             r["evict_store_cpu_ns_per_block"], r["open_s"], r["open_s_per_million"], r["open_cpu_s_per_million"],
             r["open_vs_raw_cursor"],
             r["rss_bytes_per_block"], r["traced_bytes_per_block"], r["lmdb_bytes_per_block"]]
            for k, r in results.items()]
    print_table("The disk tier as it grows (a new process opens the filled directory)",
                ["size/blocks", "store ns/blk", "CPU", "hit ns/blk", "CPU", "miss ns/blk", "evict-store ns/blk", "CPU",
                 "open s",
                 "open s/10^6", "open CPU s/10^6", "open/raw cursor", "RSS B/blk", "traced B/blk", "LMDB B/blk"], rows)
    for key, r in results.items():
        if "raw_write_gbps" in r:
            print(f"{key}: store {r['store_gbps']:.3f} GB/s against a plain file write of the same bytes "
                  f"{r['raw_write_gbps']:.3f} GB/s ({r['store_vs_raw_write']:.2f}x)")
    return {"goals": {"open_s_per_million": GOAL_OPEN_S_PER_MILLION, "index_bytes_per_block": GOAL_INDEX_BYTES},
            "hash_bytes": 16, "load_average": os.getloadavg(), "results": results}


@click.command("scale-disk", help=__doc__, context_settings=CONTEXT)
@click.option("--blocks", "counts", type=click.IntRange(min=100), multiple=True, default=(10**5, 10**6, 10**7),
              show_default=True, help="Tier sizes in blocks (repeat the option).")
@click.option("--payload-mib", type=click.FloatRange(min=0.0625), default=2.0, show_default=True)
@click.option("--payload-blocks", type=click.IntRange(min=0), default=10**4, show_default=True,
              help="Blocks of the real-payload size (0: skip it).")
@click.option("--dir", "root", type=click.Path(file_okay=False, exists=True), default=None,
              help="Where the tiers are filled (default: the temporary directory; 10^7 tiny blocks take ~4 GB).")
def command(counts: tuple[int, ...], payload_mib: float, payload_blocks: int, root: str | None) -> None:
    write_results("scale_disk", run(sorted(counts), payload_mib, payload_blocks, root))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench scale-disk")
