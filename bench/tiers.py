"""Store and retrieve bandwidth of each tier against physical baselines from the same run.

Run: `kvstrata bench tiers [--mib N] [--sizes 16K,64K,...]`. For each block size, a context
of about N MiB of KV is stored into and retrieved from a pool-only store (the pool is in
host memory without CUDA), a CPU-only store and a disk-only store (LMDB, fsync on commit).
Baselines, measured in the same run on the same bytes:
`numpy.copyto` of the whole buffer (memory), and a raw file write + fsync and a read with
the page cache dropped (`posix_fadvise(DONTNEED)`) and warm (disk). Ratios are tier GB/s
over baseline GB/s. `retrieve` allocates its result (its page faults are part of the cost);
`retrieve(out=)` and the disk rows write into a preallocated buffer, like the baselines.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

from bench.args import CONTEXT, Choices, Directory, invoke, positive
from bench.common import drop_file_cache, print_table, timeit, write_results
from bench.progress import tqdm
from kvstore import KVCacheStore, KVLayout, StoreConfig

TOKEN_KV_HEADS, TOKEN_HEAD_DIM = 8, 128  # a Llama-3-8B-like head shape: 4 KiB/token/layer in bf16
SIZES = {"16K": (4, 1), "64K": (16, 1), "256K": (16, 4), "1M": (16, 16), "4M": (16, 64)}  # (block_size, layers)


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def baseline_memory(src: np.ndarray, repeat: int) -> float:
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination's pages in: time copies, not page faults
    return _gbps(src.nbytes, timeit(lambda: np.copyto(dst, src), repeat=repeat))


def baseline_disk(src: np.ndarray, workdir: Path, repeat: int) -> tuple[float, float, float]:
    """(write+fsync, cold read, warm read) GB/s of one raw file holding `src`."""
    path = workdir / "raw.bin"

    def write() -> None:
        with open(path, "wb") as f:
            f.write(memoryview(src).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    w = _gbps(src.nbytes, timeit(write, repeat=repeat))
    buf = bytearray(src.nbytes)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    cold = _gbps(src.nbytes, timeit(read, repeat=repeat, setup=lambda: drop_file_cache(path)))
    warm = _gbps(src.nbytes, timeit(read, repeat=repeat))
    path.unlink()
    return w, cold, warm


def bench_size(label: str, mib: int, workdir: Path, repeat: int) -> dict[str, float]:
    block_size, layers = SIZES[label]
    layout = KVLayout(layers, TOKEN_KV_HEADS, TOKEN_HEAD_DIM, torch.bfloat16)
    block_bytes = layout.block_bytes(block_size)
    num_blocks = max(4, (mib << 20) // block_bytes)
    num_tokens = num_blocks * block_size
    kv = torch.randn(layout.block_shape(num_tokens), dtype=torch.float32).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    src = kv.view(torch.uint8).numpy().reshape(-1)
    rng = np.random.default_rng(0)
    out: dict[str, float] = {"block_bytes": block_bytes, "num_blocks": num_blocks, "total_bytes": nbytes}

    out["memcpy_gbps"] = baseline_memory(src, repeat)
    raw = baseline_disk(src, workdir, repeat)
    out["raw_write_gbps"], out["raw_read_cold_gbps"], out["raw_read_warm_gbps"] = raw

    def fresh_tokens() -> list[int]:
        return rng.integers(0, 2**31, size=num_tokens).tolist()

    dst = torch.zeros_like(kv)  # a caller's preallocated, faulted-in buffer for retrieve(out=)

    def time_store(store: KVCacheStore) -> tuple[float, list[int]]:
        """Median store time of fresh sequences (the tier emptied, untimed, between runs);
        then one more stored for the retrieves."""
        times = []
        for _ in range(repeat):
            fresh = fresh_tokens()
            t0 = time.perf_counter()
            store.store(fresh, kv)
            times.append(time.perf_counter() - t0)
            store.clear()
        tokens = fresh_tokens()
        store.store(tokens, kv)
        return sorted(times)[len(times) // 2], tokens

    # Pool tier (host memory here unless CUDA): capacity for everything.
    cfg = StoreConfig(layout, block_size=block_size, pool_blocks=num_blocks + 1, cpu_bytes=0)
    with KVCacheStore(cfg) as store:
        t_store, tokens = time_store(store)
        t_get = timeit(lambda: store.retrieve(tokens, device=kv.device), repeat=repeat)
        t_into = timeit(lambda: store.retrieve(tokens, out=dst), repeat=repeat)
        out["pool_store_gbps"], out["pool_retrieve_gbps"] = _gbps(nbytes, t_store), _gbps(nbytes, t_get)
        out["pool_retrieve_out_gbps"] = _gbps(nbytes, t_into)

    # CPU tier: capacity for everything.
    cfg = StoreConfig(layout, block_size=block_size, cpu_bytes=(num_blocks + 1) * block_bytes)
    with KVCacheStore(cfg) as store:
        t_store, tokens = time_store(store)
        assert store.lookup(tokens) == num_tokens
        t_get = timeit(lambda: store.retrieve(tokens), repeat=repeat)
        t_into = timeit(lambda: store.retrieve(tokens, out=dst), repeat=repeat)
        out["cpu_store_gbps"], out["cpu_retrieve_gbps"] = _gbps(nbytes, t_store), _gbps(nbytes, t_get)
        out["cpu_retrieve_out_gbps"] = _gbps(nbytes, t_into)

    # Disk tier: LMDB only, fsync per commit.
    disk = workdir / f"lmdb-{label}"
    cfg = StoreConfig(layout, block_size=block_size, cpu_bytes=0, disk_path=str(disk),
                      disk_bytes=3 * nbytes + (64 << 20), disk_sync=True)
    with KVCacheStore(cfg) as store:
        t_disk_store, tokens = time_store(store)
        t_warm = timeit(lambda: store.retrieve(tokens, out=dst), repeat=repeat)
        res = store.retrieve(tokens)
        assert res.num_tokens == num_tokens and torch.equal(res.kv.view(torch.int16), kv.view(torch.int16))
    # Cold: the page cache cannot drop pages a process has mapped, so each read reopens the
    # store after dropping the file's pages (the reopen itself is not timed).
    colds = []
    for _ in range(repeat):
        drop_file_cache(disk / "data.mdb")
        with KVCacheStore(cfg) as store:
            t0 = time.perf_counter()
            store.retrieve(tokens, out=dst)
            colds.append(time.perf_counter() - t0)
    t_cold = sorted(colds)[len(colds) // 2]
    shutil.rmtree(disk)
    out["disk_store_gbps"] = _gbps(nbytes, t_disk_store)
    out["disk_retrieve_cold_gbps"], out["disk_retrieve_warm_gbps"] = _gbps(nbytes, t_cold), _gbps(nbytes, t_warm)
    return out


def run(
    mib: int = 64, sizes: list[str] | None = None, repeat: int = 3, workdir: str | None = None
) -> dict[str, object]:
    sizes = sizes or list(SIZES)
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=workdir))
    results = {}
    try:
        for label in tqdm(sizes, desc="block sizes", disable=None):
            results[label] = bench_size(label, mib, tmp, repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pairs = [  # (operation, tier key, baseline name, baseline key)
        ("pool store", "pool_store_gbps", "memcpy", "memcpy_gbps"),
        ("pool retrieve", "pool_retrieve_gbps", "memcpy", "memcpy_gbps"),
        ("pool retrieve(out=)", "pool_retrieve_out_gbps", "memcpy", "memcpy_gbps"),
        ("cpu store", "cpu_store_gbps", "memcpy", "memcpy_gbps"),
        ("cpu retrieve", "cpu_retrieve_gbps", "memcpy", "memcpy_gbps"),
        ("cpu retrieve(out=)", "cpu_retrieve_out_gbps", "memcpy", "memcpy_gbps"),
        ("disk store", "disk_store_gbps", "write+fsync", "raw_write_gbps"),
        ("disk retrieve cold", "disk_retrieve_cold_gbps", "read cold", "raw_read_cold_gbps"),
        ("disk retrieve warm", "disk_retrieve_warm_gbps", "read warm", "raw_read_warm_gbps"),
    ]
    rows = []
    for label, r in results.items():
        for op, key, base, base_key in pairs:
            r[key.replace("_gbps", "_ratio")] = r[key] / r[base_key]
            rows.append([label, op, r[key], base, r[base_key], r[key] / r[base_key]])
    print_table(f"Tier bandwidth, ~{mib} MiB of bf16 KV per block size (median of {repeat})",
                ["block", "operation", "GB/s", "baseline", "base GB/s", "ratio"], rows)
    # Per-block overhead: time beyond what memcpy needs for the same bytes, per block.
    over_rows = []
    for label, r in results.items():
        t_copy = r["total_bytes"] / (r["memcpy_gbps"] * 1e9)
        for op in ("pool_store", "pool_retrieve_out", "pool_retrieve", "cpu_store", "cpu_retrieve_out",
                   "cpu_retrieve"):
            t_op = r["total_bytes"] / (r[f"{op}_gbps"] * 1e9)
            r[f"{op}_overhead_us_per_block"] = (t_op - t_copy) / r["num_blocks"] * 1e6
        over_rows.append([label, int(r["num_blocks"]), *(r[f"{op}_overhead_us_per_block"] for op in (
            "pool_store", "pool_retrieve_out", "pool_retrieve", "cpu_store", "cpu_retrieve_out", "cpu_retrieve"))])
    print_table("Per-block overhead over memcpy of the same bytes (us per block)",
                ["block", "blocks", "pool store", "pool retrieve(out=)", "pool retrieve", "cpu store",
                 "cpu retrieve(out=)", "cpu retrieve"], over_rows)
    return {"mib": mib, "repeat": repeat, "sizes": results}


@click.command("tiers", help=__doc__, context_settings=CONTEXT)
@click.option("--mib", type=positive(), default=64, show_default=True, help="MiB of KV per block size")
@click.option("--sizes", type=Choices(list(SIZES), str.upper), default=",".join(SIZES), show_default=True,
              help="block sizes to measure")
@click.option("--repeat", type=positive(), default=3, show_default=True)
@click.option("--workdir", type=Directory(), default=None,
              help="directory on the disk to measure (default: system tmp)")
def command(mib: int, sizes: list[str], repeat: int, workdir: str | None) -> None:
    write_results("tiers", run(mib, sizes, repeat, workdir))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench tiers")
