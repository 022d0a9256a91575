"""Store and retrieve bandwidth of each tier against physical baselines from the same run.

Run: `kvstrata bench tiers [--mib N] [--sizes 16K,64K,...]`. For each block size, a context
of about N MiB of KV is stored into and retrieved from a pool-only store (the pool is in
host memory without CUDA), a CPU-only store, and a disk-only store in each durability mode
(`bench/tiers_disk.py`). Baselines, measured in the same run on the same bytes:
`numpy.copyto` of the whole buffer (memory); raw file writes (with `fdatasync` for the
`commit` mode), and reads with the page cache dropped (`posix_fadvise(DONTNEED)`) and warm,
timed interleaved with the disk tier (disk). Ratios are tier GB/s over baseline GB/s.
`retrieve` allocates its result (its page faults are part of the cost); `retrieve(out=)` and
the disk reads write into a preallocated buffer, like the baselines. Then: `lookup()` of a
prompt held on disk against hashing it alone, and allocating `retrieve()` against
`retrieve(out=)` for long prompts of a Llama-3-8B layout (`--long-tokens`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import torch

from bench.common import timeit
from bench.tiers_disk import disk_rows, lookup_rows
from cli.args import CONTEXT, Choices, Directory, IntList, invoke, positive
from cli.output import print_table, write_results
from cli.progress import tqdm
from kvstore import KVCacheStore, KVLayout, StoreConfig

TOKEN_KV_HEADS, TOKEN_HEAD_DIM = 8, 128  # a Llama-3-8B-like head shape: 4 KiB/token/layer in bf16
LONG_LAYOUT = KVLayout(32, 8, 128, torch.bfloat16)  # Llama-3-8B: 128 KiB of KV per token
SIZES = {"16K": (4, 1), "64K": (16, 1), "256K": (16, 4), "1M": (16, 16), "4M": (16, 64)}  # (block_size, layers)


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def baseline_memory(src: np.ndarray, repeat: int) -> float:
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination's pages in: time copies, not page faults
    return _gbps(src.nbytes, timeit(lambda: np.copyto(dst, src), repeat=repeat))


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

    out.update(disk_rows(layout, block_size, kv, workdir, repeat, fresh_tokens, dst))
    return out


def long_rows(token_counts: list[int], workdir: Path, repeat: int) -> dict[str, dict[str, float]]:
    """Allocating `retrieve()` against `retrieve(out=)` for long prompts (Llama-3-8B layout,
    128 KiB per token, 256-token blocks), from the CPU tier and from a warm disk tier,
    interleaved."""
    out: dict[str, dict[str, float]] = {}
    for n in token_counts:
        kv = torch.zeros(LONG_LAYOUT.block_shape(n), dtype=LONG_LAYOUT.dtype)
        kv.view(torch.int16).random_()
        row: dict[str, float] = {"bytes": kv.numel() * kv.element_size()}
        for tier in ("cpu", "disk"):
            row.update(_long_one(tier, kv, workdir, repeat))
        out[str(n)] = row
    return out


def _long_one(tier: str, kv: torch.Tensor, workdir: Path, repeat: int) -> dict[str, float]:
    n, nbytes = kv.shape[2], kv.numel() * kv.element_size()
    dst = torch.zeros_like(kv)
    tokens = np.random.default_rng(n).integers(0, 2**31, size=n).tolist()
    cfg = (StoreConfig(LONG_LAYOUT, block_size=256, cpu_bytes=nbytes + LONG_LAYOUT.block_bytes(256)) if tier == "cpu"
           else StoreConfig(LONG_LAYOUT, block_size=256, cpu_bytes=0, disk_path=str(workdir / "long"),
                            disk_bytes=2 * nbytes + (64 << 20), disk_sync=False))
    with KVCacheStore(cfg) as store:
        store.store(tokens, kv)
        store.retrieve(tokens)  # the first allocation of that size, untimed
        t_alloc, t_out = _interleaved(lambda: store.retrieve(tokens), lambda: store.retrieve(tokens, out=dst), repeat)
    shutil.rmtree(workdir / "long", ignore_errors=True)
    return {f"{tier}_retrieve_gbps": _gbps(nbytes, t_alloc), f"{tier}_retrieve_out_gbps": _gbps(nbytes, t_out)}


def _interleaved(a: Callable[[], object], b: Callable[[], object], repeat: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(repeat):
        for fn, ts in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]


def run(mib: int = 64, sizes: list[str] | None = None, repeat: int = 3, workdir: str | None = None,
        lookup_tokens: list[int] | None = None, long_tokens: list[int] | None = None) -> dict[str, object]:
    sizes = sizes or list(SIZES)
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=workdir))
    results: dict[str, dict[str, float]] = {}
    try:
        for label in tqdm(sizes, desc="block sizes", disable=None):
            results[label] = bench_size(label, mib, tmp, repeat)
        lookups = lookup_rows(tmp, tuple(lookup_tokens or (1024, 4096)))
        long = long_rows(long_tokens or [], tmp, repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _print_memory(results, mib, repeat)
    _print_disk(results, repeat)
    print_table("Disk lookup() of a prompt held on disk (Llama-3-8B layout, 256-token blocks), us",
                ["tokens", "lookup", "hashing alone", "probe (lookup - hashing)"],
                [[n, r["lookup_us"], r["hash_only_us"], r["probe_us"]] for n, r in lookups.items()])
    rows = []
    for n, r in long.items():
        for tier in ("cpu", "disk"):
            a, b = r[f"{tier}_retrieve_gbps"], r[f"{tier}_retrieve_out_gbps"]
            r[f"{tier}_retrieve_vs_out"] = a / b
            rows.append([n, f"{r['bytes'] / 2**30:.2f}", tier, a, b, a / b])
    if rows:
        print_table(f"Allocating retrieve() against retrieve(out=), Llama-3-8B layout (median of {repeat})",
                    ["tokens", "GiB", "tier", "retrieve GB/s", "retrieve(out=) GB/s", "ratio"], rows)
    return {"mib": mib, "repeat": repeat, "sizes": results, "lookup": lookups, "long": long}


def _print_memory(results: dict[str, dict[str, float]], mib: int, repeat: int) -> None:
    ops = ["pool_store", "pool_retrieve", "pool_retrieve_out", "cpu_store", "cpu_retrieve", "cpu_retrieve_out"]
    rows = []
    for label, r in results.items():
        for op in ops:
            key = f"{op}_gbps"
            r[f"{op}_ratio"] = r[key] / r["memcpy_gbps"]
            rows.append([label, op.replace("_", " ").replace("retrieve out", "retrieve(out=)"), r[key], "memcpy",
                         r["memcpy_gbps"], r[key] / r["memcpy_gbps"]])
    print_table(f"Memory tiers, ~{mib} MiB of bf16 KV per block size (median of {repeat})",
                ["block", "operation", "GB/s", "baseline", "base GB/s", "ratio"], rows)
    over_rows = []
    for label, r in results.items():
        t_copy = r["total_bytes"] / (r["memcpy_gbps"] * 1e9)
        for op in ops:
            t_op = r["total_bytes"] / (r[f"{op}_gbps"] * 1e9)
            r[f"{op}_overhead_us_per_block"] = (t_op - t_copy) / r["num_blocks"] * 1e6
        over_rows.append([label, int(r["num_blocks"]), *(r[f"{op}_overhead_us_per_block"] for op in ops)])
    print_table("Per-block overhead over memcpy of the same bytes (us per block)",
                ["block", "blocks", *(op.replace("_", " ") for op in ops)], over_rows)


def _print_disk(results: dict[str, dict[str, float]], repeat: int) -> None:
    rows = []
    for label, r in results.items():
        for m in ("commit", "group", "none"):
            base = "write+fdatasync" if m == "commit" else "write"
            for kind, where in (("fill", "new file"), ("reuse", "over a file")):
                key, base_key = f"disk_{kind}_{m}_gbps", f"raw_{kind}_{m}_gbps"
                r[key.replace("_gbps", "_ratio")] = r[key] / r[base_key]
                rows.append([label, f"store, {m}, {kind}", r[key], f"{base} ({where})", r[base_key],
                             r[key] / r[base_key]])
        for kind in ("warm", "cold"):
            key, base_key = f"disk_read_{kind}_gbps", f"raw_read_{kind}_gbps"
            r[key.replace("_gbps", "_ratio")] = r[key] / r[base_key]
            rows.append([label, f"retrieve(out=) {kind}", r[key], f"read {kind}", r[base_key], r[key] / r[base_key]])
    print_table(f"Disk tier against raw file I/O on the same bytes, A/B interleaved (median of {repeat})",
                ["block", "operation", "GB/s", "baseline", "base GB/s", "ratio"], rows)


@click.command("tiers", help=__doc__, context_settings=CONTEXT)
@click.option("--mib", type=positive(), default=64, show_default=True, help="MiB of KV per block size")
@click.option("--sizes", type=Choices(list(SIZES), str.upper), default=",".join(SIZES), show_default=True,
              help="block sizes to measure")
@click.option("--repeat", type=positive(), default=3, show_default=True)
@click.option("--workdir", type=Directory(), default=None,
              help="directory on the disk to measure (default: system tmp)")
@click.option("--lookup-tokens", type=IntList(256), default="1024,4096", show_default=True,
              help="prompt lengths of the disk lookup rows")
@click.option("--long-tokens", type=IntList(256), default="4096,8192", show_default=True,
              help="prompt lengths of the long retrieve rows (128 KiB of KV per token; each needs ~4x that in RAM)")
def command(mib: int, sizes: list[str], repeat: int, workdir: str | None, lookup_tokens: list[int],
            long_tokens: list[int]) -> None:
    write_results("tiers", run(mib, sizes, repeat, workdir, lookup_tokens, long_tokens))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench tiers")
