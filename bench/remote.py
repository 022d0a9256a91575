"""The remote tier (Valkey/Redis) against the same server driven directly, in one run.

Run: `kvstrata bench remote [--url redis://host:port] [--mib N] [--sizes 16K,256K,2M]`.
Without `--url` a `redis-server` is started on a loopback port for the run. For each block
size, about N MiB of KV is stored through a remote-only `KVCacheStore` (timed until
`flush()` returns: every block on the server) and retrieved back; the baselines, measured
in the same run on the same bytes and the same client library: a pipelined raw `SET` of the
same values and a pipelined raw `GET` of them through the tier's own client configuration
(the client's limit), and, where
`redis-benchmark` is installed, the server's own loopback limit (`redis-benchmark -P 16`,
SET and GET of one value of the block's size). Ratios are store GB/s over raw-client GB/s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Any

import click
import numpy as np
import torch

from bench.args import CONTEXT, Choices, invoke, positive
from bench.common import print_table, write_results
from bench.progress import tqdm
from bench.redis_servers import server_url
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.remote import connect

SIZES = {"16K": (4, 1), "256K": (16, 4), "2M": (16, 32)}  # (block_size, layers) at 4 KiB/token/layer


def _raw_client(url: str) -> Any:
    """The very client the tier uses (same timeouts, read size, parser): the baseline then
    isolates what kvstrata adds (records, checksums, copies, the background writer)."""
    return connect(url, timeout_s=10.0)


def _redis_benchmark(url: str, size: int, count: int) -> dict[str, float]:
    """The server's own loopback limit for values of `size` bytes (GB/s), if installed."""
    tool = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if tool is None or not url.startswith("redis://"):
        return {}
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    out = subprocess.run([tool, "-h", host, "-p", port, "-t", "set,get", "-d", str(size), "-n", str(count),
                          "-P", "16", "-q", "-r", "1000"], capture_output=True, text=True, timeout=120).stdout
    rates = {m.group(1).lower(): float(m.group(2)) for m in re.finditer(r"(SET|GET): ([\d.]+) requests", out)}
    return {f"server_{k}_gbps": v * size / 1e9 for k, v in rates.items()}


def bench_size(url: str, label: str, mib: int, repeat: int) -> dict[str, float]:
    block_size, layers = SIZES[label]
    layout = KVLayout(layers, 8, 128, torch.bfloat16)
    block_bytes = layout.block_bytes(block_size)
    n = max(8, (mib << 20) // block_bytes)
    kv = torch.randn(layout.block_shape(n * block_size)).to(layout.dtype)
    nbytes = n * block_bytes
    best: dict[str, float] = {}
    for r in range(repeat):
        tokens = list(range(r * 10_000_000, r * 10_000_000 + n * block_size))
        cfg = StoreConfig(layout, block_size=block_size, namespace=f"bench-remote-{label}", cpu_bytes=0,
                          remote_url=url, remote_timeout_s=10.0)
        with KVCacheStore(cfg) as store:
            t0 = time.perf_counter()
            store.store(tokens, kv)
            assert store.flush()
            t_store = time.perf_counter() - t0
            out = torch.zeros_like(kv)  # a caller's buffer, pages already faulted in (as it is reused)
            t_get = float("inf")
            for _ in range(2):  # the first read also opens the reading connection: best of two
                t0 = time.perf_counter()
                res = store.retrieve(tokens, out=out)
                t_get = min(t_get, time.perf_counter() - t0)
            assert res.num_tokens == len(tokens) and torch.equal(out.view(torch.int16), kv.view(torch.int16))
            store.clear()
        # The raw client: the same values (records of the same size) pipelined in one batch.
        client = _raw_client(url)
        values = [np.random.default_rng(i).bytes(block_bytes + 200) for i in range(min(n, 64))]
        keys = [f"rawbench:{label}:{r}:{i}".encode() for i in range(n)]
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i, k in enumerate(keys):
            pipe.set(k, values[i % len(values)])
        pipe.execute()
        t_raw_set = time.perf_counter() - t0
        t_raw_get = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            got = pipe.execute()
            t_raw_get = min(t_raw_get, time.perf_counter() - t0)
        assert all(g is not None for g in got)
        client.delete(*keys)
        client.close()
        for name, t in (("store", t_store), ("retrieve", t_get), ("raw_set", t_raw_set), ("raw_get", t_raw_get)):
            best[name] = max(best.get(name, 0.0), nbytes / t / 1e9)
    result = {"block_bytes": block_bytes, "num_blocks": n, **{f"{k}_gbps": v for k, v in best.items()}}
    result["store_ratio"] = result["store_gbps"] / result["raw_set_gbps"]
    result["retrieve_ratio"] = result["retrieve_gbps"] / result["raw_get_gbps"]
    result["store_us_per_block"] = block_bytes / (result["store_gbps"] * 1e3)
    result.update(_redis_benchmark(url, block_bytes, max(200, min(20_000, (256 << 20) // block_bytes))))
    return result


def run(url: str | None, mib: int, sizes: list[str], repeat: int) -> dict[str, object]:
    with server_url(url) as target:
        results = {label: bench_size(target, label, mib, repeat)
                   for label in tqdm(sizes, desc="block sizes", leave=False, disable=None)}
    rows = []
    for label, r in results.items():
        rows.append([label, "store", r["store_gbps"], r["raw_set_gbps"], r["store_ratio"],
                     r.get("server_set_gbps", "-")])
        rows.append([label, "retrieve", r["retrieve_gbps"], r["raw_get_gbps"], r["retrieve_ratio"],
                     r.get("server_get_gbps", "-")])
    print_table(f"Remote tier vs the raw client on the same server, ~{mib} MiB per size (best of {repeat})",
                ["block", "op", "tier GB/s", "raw client GB/s", "ratio", "redis-benchmark GB/s"], rows)
    return {"mib": mib, "url": "loopback redis-server" if url is None else "given", "sizes": results}


@click.command("remote", help=__doc__, context_settings=CONTEXT)
@click.option("--url", default=None, help="a server to measure (default: start redis-server on loopback)")
@click.option("--mib", type=positive(), default=64, show_default=True)
@click.option("--sizes", type=Choices(list(SIZES), str.upper), default=",".join(SIZES), show_default=True,
              help="block sizes to measure")
@click.option("--repeat", type=positive(), default=3, show_default=True)
def command(url: str | None, mib: int, sizes: list[str], repeat: int) -> None:
    write_results("remote", run(url, mib, sizes, repeat))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench remote")
