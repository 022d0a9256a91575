"""The remote tier (Valkey/Redis) against the same server driven directly, in one run.

Run: `kvstrata bench remote [--url URL] [--topology standalone,cluster] [--sizes 16K,256K,2M,prompt]
[--mib N] [--repeat R]`. Without `--url` it starts its own loopback servers: one `redis-server`
and a 3-master cluster. For each block size, about N MiB of KV (`prompt`: 4,096 tokens of a
Llama-3-8B layout, 512 MiB in 2 MiB blocks) is stored through a remote-only `KVCacheStore`
(timed until `flush()` returns: every block on the server) and retrieved into a caller's
buffer (best of two). Baselines, in the same round, in rotating order (A/B interleaved):

- `raw`: a redis-py pipeline of SET, then of GET, of as many values of the record's size
  (the plain client a user would write, through the tier's client configuration);
- `server`: the server's own loopback limit, `redis-benchmark -P 16 -d SIZE` SET and GET
  (C, pipelined, `--cluster` for a cluster), best of 1 client and of `min(50, 256 MiB /
  (16 x SIZE))` clients; GET counts only hits. Run only against servers the bench started
  (it writes `key:*` keys and flushes them).

Ratios are taken within each round and summarized by their median (min-max over rounds).
The machine's load average is recorded before and after: on a small shared machine the
client, the server and `redis-benchmark` compete for the same cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import numpy as np
import torch

from bench.common import time_store_retrieve
from cli.args import CONTEXT, Choices, invoke, positive
from cli.output import print_table, write_results
from cli.progress import tqdm
from cli.redis_servers import RedisServer, check_server, redis_binary, redis_cluster
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.remote.tier import connect

# (layers, block_size, tokens or None for --mib) at 8 KV heads x 128 dims in bf16 (4 KiB/token/layer)
SIZES: dict[str, tuple[int, int, int | None]] = {
    "16K": (1, 4, None), "256K": (4, 16, None), "2M": (32, 16, None), "prompt": (32, 16, 4096)}
TOPOLOGIES = ("standalone", "cluster")
_IN_FLIGHT_MIB = 256  # redis-benchmark's clients x 16 x SIZE stays under this


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _tier(url: str, label: str, rnd: int, kv: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    layers, block_size, _ = SIZES[label]
    layout = KVLayout(layers, 8, 128, torch.bfloat16)
    tokens = list(range(rnd * 10_000_000, rnd * 10_000_000 + kv.shape[2]))
    cfg = StoreConfig(layout, block_size=block_size, namespace=f"bench-remote-{label}", cpu_bytes=0,
                      remote_url=url)  # the default remote_timeout_s: the deadlines users get
    with KVCacheStore(cfg) as store:
        t_store, t_get = time_store_retrieve(store, tokens, kv, out, f"{label}: ")
    nbytes = kv.numel() * kv.element_size()
    return {"store": _gbps(nbytes, t_store), "retrieve": _gbps(nbytes, t_get)}


def _raw(url: str, label: str, rnd: int, num: int, size: int) -> dict[str, float]:
    client = connect(url, timeout_s=30.0)
    values = [np.random.default_rng(i).bytes(size) for i in range(min(num, 16))]
    keys = [f"rawbench:{label}:{rnd}:{i}".encode() for i in range(num)]
    try:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i, k in enumerate(keys):
            pipe.set(k, values[i % len(values)])
        pipe.execute()
        t_set = time.perf_counter() - t0
        t_get = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            got = pipe.execute()
            t_get = min(t_get, time.perf_counter() - t0)
        assert all(g is not None and len(g) == size for g in got)
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.delete(k)
        pipe.execute()
    finally:
        client.close()
    return {"set": _gbps(num * size, t_set), "get": _gbps(num * size, t_get)}


def _benchmark_tool() -> str | None:
    return shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")


def _stats(ports: list[int]) -> tuple[int, int]:
    """(keyspace hits, misses) summed over the servers on `ports`."""
    hits = misses = 0
    for port in ports:
        client = connect(f"redis://127.0.0.1:{port}", timeout_s=10.0)
        info = client.info("stats")
        client.close()
        hits, misses = hits + int(info["keyspace_hits"]), misses + int(info["keyspace_misses"])
    return hits, misses


def _flush(ports: list[int]) -> None:
    for port in ports:
        client = connect(f"redis://127.0.0.1:{port}", timeout_s=30.0)
        client.flushall()
        client.close()


def _server(ports: list[int], cluster: bool, size: int, mib: int) -> dict[str, float]:
    """redis-benchmark -P 16 -d `size`, SET then GET of about `mib` MiB, at 1 client and at
    many; GB/s of the better of the two for each (GET: hits only). Leaves the servers empty."""
    tool = _benchmark_tool()
    assert tool is not None
    keyspace = max(16, min(1000, (128 << 20) // size))  # every key fits in memory: GETs hit
    best = {"set": 0.0, "get": 0.0}
    for clients in sorted({1, max(1, min(50, (_IN_FLIGHT_MIB << 20) // (16 * size)))}):
        count = max(32 * clients, (mib << 20) // size) // (16 * clients) * 16 * clients  # whole pipelines
        for op in ("set", "get"):
            before = _stats(ports)
            out = subprocess.run([tool, "-p", str(ports[0]), *(["--cluster"] if cluster else []), "-t", op,
                                  "-d", str(size), "-n", str(count), "-c", str(clients), "-P", "16", "-r",
                                  str(keyspace), "-q"], capture_output=True, text=True, timeout=300)
            found = re.findall(r"(?:SET|GET): ([\d.]+) requests per second", out.stdout.replace("\r", "\n"))
            if not found:
                raise RuntimeError(f"redis-benchmark ({op}, {clients} clients) exited {out.returncode} with no rate: "
                                   f"{out.stdout[-200:]!r} {out.stderr[-300:]!r}")
            hits, misses = (a - b for a, b in zip(_stats(ports), before))
            share = hits / max(1, hits + misses) if op == "get" else 1.0
            best[op] = max(best[op], float(found[-1]) * size * share / 1e9)
        _flush(ports)
    return best


def bench_size(url: str, ports: list[int] | None, cluster: bool, label: str, mib: int,
               repeat: int) -> dict[str, Any]:
    """One block size: every measurement `repeat` times, in rotating order; rates and ratios."""
    layers, block_size, prompt_tokens = SIZES[label]
    layout = KVLayout(layers, 8, 128, torch.bfloat16)
    block_bytes = layout.block_bytes(block_size)
    num = prompt_tokens // block_size if prompt_tokens else max(8, (mib << 20) // block_bytes)
    kv = torch.randn(layout.block_shape(num * block_size)).to(layout.dtype)
    out = torch.zeros_like(kv)  # a caller's buffer, pages already faulted in (as it is reused)
    record_bytes = block_bytes + 256  # a record's header is ~150-250 bytes
    runs: dict[str, Callable[[int], dict[str, float]]] = {
        "tier": lambda r: _tier(url, label, r, kv, out),
        "raw": lambda r: _raw(url, label, r, num, record_bytes)}
    if ports:
        runs["server"] = lambda r: _server(ports, cluster, record_bytes, max(32, 4 * mib))
    rounds: list[dict[str, float]] = []
    for r in range(repeat):
        names = list(runs)
        got: dict[str, float] = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            got.update({f"{name}_{k}_gbps": v for k, v in runs[name](r).items()})
        for a, b in (("store", "set"), ("retrieve", "get")):
            for base in ("raw", "server"):
                if f"{base}_{b}_gbps" in got:
                    got[f"{a}_vs_{base}"] = got[f"tier_{a}_gbps"] / got[f"{base}_{b}_gbps"]
        rounds.append(got)
    summary = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    spread = {k: (min(r[k] for r in rounds), max(r[k] for r in rounds)) for k in rounds[0] if "_vs_" in k}
    return {"block_bytes": block_bytes, "num_blocks": num, "median": summary, "ratio_range": spread,
            "rounds": rounds}


@contextlib.contextmanager
def _target(topology: str, url: str | None) -> Iterator[tuple[str, list[int] | None]]:
    """(URL, ports of servers the bench started, None for a given URL). A given URL is
    checked first (one line naming it if no server answers there); without one a
    `redis-server` must be installed (`RedisServerError` naming how to get it)."""
    if url is not None:
        check_server(url, "--url")
        yield url, None
        return
    redis_binary("--url")
    if topology == "cluster":
        with redis_cluster(3) as cluster:
            yield cluster.url, [s.port for s in cluster.servers]
        return
    server = RedisServer(None, "--maxmemory", "3gb").start()  # the prompt's 512 MiB and the baselines'
    try:
        yield server.url, [server.port]
    finally:
        server.stop()


def run(url: str | None, topologies: list[str], mib: int, sizes: list[str], repeat: int) -> dict[str, object]:
    if url is not None:
        topologies = ["cluster" if "+cluster" in url else "standalone"]
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    for topology in topologies:
        with _target(topology, url) as (target, ports):
            if ports and _benchmark_tool() is None:
                ports = None
                print("redis-benchmark is not installed: no server baseline")
            results[topology] = {label: bench_size(target, ports, topology == "cluster", label, mib, repeat)
                                 for label in tqdm(sizes, desc=topology, leave=False, disable=None)}
    load = [round(x, 1) for x in (*load_before, *os.getloadavg())]
    rows = []
    for topology, by_size in results.items():
        for label, res in by_size.items():
            med, rng = res["median"], res["ratio_range"]
            for a, b in (("store", "set"), ("retrieve", "get")):
                rows.append([topology, label, a, med[f"tier_{a}_gbps"], med[f"raw_{b}_gbps"],
                             med.get(f"server_{b}_gbps", "-"), _ratio(med, rng, f"{a}_vs_raw"),
                             _ratio(med, rng, f"{a}_vs_server")])
    print_table(f"Remote tier vs a raw redis-py pipeline and redis-benchmark -P 16, same server, same round; "
                f"medians of {repeat} rounds (load average before {load[:3]}, after {load[3:]})",
                ["topology", "block", "op", "tier GB/s", "raw GB/s", "server GB/s", "tier/raw", "tier/server"], rows)
    return {"mib": mib, "repeat": repeat, "url": "loopback servers started by the bench" if url is None else "given",
            "load_average_before_after": load, "results": results}


def _ratio(median: dict[str, float], spread: dict[str, tuple[float, float]], key: str) -> str:
    if key not in median:
        return "-"
    low, high = spread[key]
    return f"{median[key]:.2f} ({low:.2f}-{high:.2f})"


@click.command("remote", help=__doc__, context_settings=CONTEXT)
@click.option("--url", default=None, help="a server or cluster to measure (default: start loopback servers)")
@click.option("--topology", "topologies", type=Choices(list(TOPOLOGIES)), default=",".join(TOPOLOGIES),
              show_default=True, help="servers to start (ignored with --url)")
@click.option("--mib", type=positive(), default=64, show_default=True, help="MiB of KV per block size")
@click.option("--sizes", type=Choices(list(SIZES), lambda s: s if s == "prompt" else s.upper()),
              default=",".join(SIZES), show_default=True, help="block sizes to measure")
@click.option("--repeat", type=positive(), default=3, show_default=True, help="rounds (A/B interleaved)")
def command(url: str | None, topologies: list[str], mib: int, sizes: list[str], repeat: int) -> None:
    write_results("remote", run(url, topologies, mib, sizes, repeat))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench remote")
