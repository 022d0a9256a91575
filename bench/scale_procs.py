"""`kvstrata bench procs`: 1, 2, 4, 8 processes on one host sharing one tier.

Each of P processes, after one untimed prompt of warm-up, stores its own prompts (`--mib`
MiB of `--block-kib` KiB blocks, 8 blocks a prompt), then retrieves its own and the next process's (a lookup before each
store and each retrieve), then times `--lookups` lookups of every process's prompts; one
untimed pass checks the bytes of one own and one other prompt. Counted: prompts read back
short (misses), the tier's faults (dropped writes, server errors, damage) that explain
them, and prompts with other bytes (`wrong`: must be 0). Two configurations: one disk
tier directory (durability `none`, page cache dropped before reads), and one `redis-server`
remote tier (the bench starts it). Baselines with the same number of processes, in the same
run, before each tier run (interleaved per P): P processes writing and reading the same
bytes as plain files (`pwrite`/`preadv`, cache dropped the same way), and P redis-py clients
pipelining SET/GET of the same values. Reported: aggregate GB/s (all bytes over the span from
the first start to the last end) against raw, lookup p50/p99 against one process, and the
per-process write spread (min/max; a writer under half the median is counted starved). The
raw processes time, where the tier's time their lookups, as many CPU bursts of `BURST_US`
(a spin as long as one lookup): the p99 any call of that length gets from the scheduler
with P busy processes on the host's cores, the floor of the lookups' p99.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import click
import numpy as np
import torch

from bench.common import drop_file_cache
from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results
from cli.redis_servers import RedisServer
from kvstore import KVCacheStore, KVLayout, StoreConfig

BLOCK = 16
PROMPT_BLOCKS = 8
GOAL_VS_RAW, GOAL_P99_RATIO, STARVED_BELOW = 0.8, 2.0, 0.5
BURST_US = 50  # a CPU burst as long as a disk-tier lookup of a prompt here (p50 40-70 us)


def _layout(block_kib: int) -> KVLayout:
    return KVLayout(max(1, block_kib // 64), 8, 128, torch.float16)  # 64 KiB per layer per 16 tokens


def _tokens(q: int, i: int) -> list[int]:
    return np.random.default_rng(q * 100_003 + i).integers(0, 2**31, size=PROMPT_BLOCKS * BLOCK).tolist()


def _value(q: int, i: int) -> float:
    return float((q * 37 + i) % 2000 + 1)


def _store(kind: str, target: str, layout: KVLayout, total_bytes: int) -> KVCacheStore:
    if kind == "disk":
        return KVCacheStore(StoreConfig(layout, block_size=BLOCK, cpu_bytes=0, disk_path=target,
                                        disk_bytes=4 * total_bytes + (64 << 20), disk_sync=False))
    return KVCacheStore(StoreConfig(layout, block_size=BLOCK, cpu_bytes=0, remote_url=target))


def _burst(seconds: float) -> None:
    """Spin on the CPU until `seconds` have passed (the time a preempted spin waits counts)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _drop(path: str) -> None:
    for name in os.listdir(path):
        if name.endswith((".kvd", ".bin")):
            drop_file_cache(os.path.join(path, name))


def _warm_up(store: KVCacheStore | None, client: Any, fd: int, p: int, kv: torch.Tensor, out: torch.Tensor,
             past: int) -> None:
    """One prompt stored and read back by the path about to be timed, outside the timed prompts."""
    kv.fill_(1.0)
    if store is not None:
        store.store(_tokens(p, 10**6), kv)
        store.retrieve(_tokens(p, 10**6), out=out)
    elif client is not None:
        client.set(f"raw:warm:{p}", kv.view(torch.uint8).reshape(-1).numpy().tobytes())
        client.get(f"raw:warm:{p}")
    else:
        buf = kv.view(torch.uint8).reshape(-1).numpy()
        os.pwrite(fd, buf, past)  # past the timed prompts
        os.preadv(fd, [out.view(torch.uint8).reshape(-1).numpy()], past)


def worker(kind: str, role: str, target: str, p: int, nproc: int, prompts: int, block_kib: int, lookups: int,
           barrier: Any, queue: Any) -> None:
    """One process: write, (cache dropped), read, lookups; puts its timings on `queue`."""
    layout = _layout(block_kib)
    kv = torch.empty(layout.block_shape(PROMPT_BLOCKS * BLOCK), dtype=layout.dtype)
    out = torch.empty_like(kv)
    nbytes = kv.numel() * kv.element_size()
    mine = [(p, i) for i in range(prompts)]
    read = mine + [((p + 1) % nproc, i) for i in range(prompts)] if nproc > 1 else mine
    lat: list[float] = []
    short = wrong = 0  # prompts read back shorter than stored (misses); checked prompts with other bytes
    store = _store(kind, target, layout, nbytes * prompts * nproc) if role == "tier" else None
    client = None
    if role == "raw" and kind == "redis":
        from tiers.remote.tier import connect
        client = connect(target, timeout_s=60.0)
    fd = os.open(os.path.join(target, f"raw-{p}.bin"), os.O_RDWR | os.O_CREAT) if role == "raw" and kind == "disk" \
        else -1

    def lookup(q: int, i: int) -> int:
        assert store is not None
        t0 = time.perf_counter()
        n = store.lookup(_tokens(q, i))
        lat.append(time.perf_counter() - t0)
        return n

    _warm_up(store, client, fd, p, kv, out, prompts * nbytes)  # first-call costs (buffers, connections, files) untimed
    barrier.wait()
    w0 = time.perf_counter()
    for q, i in mine:
        kv.fill_(_value(q, i))
        if store is not None:
            lookup(q, i)
            store.store(_tokens(q, i), kv)
        elif client is not None:
            pipe = client.pipeline(transaction=False)
            for b, blk in enumerate(kv.view(torch.uint8).reshape(-1).split(nbytes // PROMPT_BLOCKS)):
                pipe.set(f"raw:{q}:{i}:{b}", blk.numpy().tobytes())
            pipe.execute()
        else:
            os.pwrite(fd, kv.view(torch.uint8).reshape(-1).numpy(), i * nbytes)
    if store is not None:
        store.flush()
    w1 = time.perf_counter()
    barrier.wait()
    if p == 0 and kind == "disk":
        _drop(target)
    barrier.wait()
    r0 = time.perf_counter()
    for q, i in read:
        if store is not None:
            lookup(q, i)
            short += store.retrieve(_tokens(q, i), out=out).num_tokens != PROMPT_BLOCKS * BLOCK
        elif client is not None:
            pipe = client.pipeline(transaction=False)
            for b in range(PROMPT_BLOCKS):
                pipe.get(f"raw:{q}:{i}:{b}")
            short += sum(v is None or len(v) != nbytes // PROMPT_BLOCKS for v in pipe.execute())
        else:
            rfd = fd if q == p else os.open(os.path.join(target, f"raw-{q}.bin"), os.O_RDONLY)
            short += os.preadv(rfd, [out.view(torch.uint8).reshape(-1).numpy()], i * nbytes) != nbytes
            if rfd != fd:
                os.close(rfd)
    r1 = time.perf_counter()
    barrier.wait()
    lookup_lat: list[float] = []
    faults = 0
    if store is not None:
        lat_io, lat = lat, []
        for j in range(lookups):
            lookup((p + j) % nproc, j % prompts)
        lookup_lat, lat = lat, lat_io
        for q, i in {read[0], read[-1]}:  # untimed: the bytes themselves, own and another's
            res = store.retrieve(_tokens(q, i), out=out)
            n = res.num_tokens
            wrong += n > 0 and not bool((out[:, :, :n] == _value(q, i)).all())
        tier = store.tiers[-1]  # type: ignore[attr-defined]
        faults = int(getattr(tier, "num_write_drops", 0)) + int(getattr(tier, "num_errors", 0)) \
            + tier.counters.num_corrupt
        store.close()
    else:  # the scheduler's floor: bursts as long as a lookup, timed as the lookups are
        for _ in range(lookups):
            t0 = time.perf_counter()
            _burst(BURST_US * 1e-6)
            lookup_lat.append(time.perf_counter() - t0)
    if client is not None:
        client.close()
    if fd >= 0:
        os.close(fd)
    queue.put({"p": p, "w0": w0, "w1": w1, "r0": r0, "r1": r1, "written": nbytes * len(mine),
               "read": nbytes * len(read), "lookup_s": lookup_lat, "io_lookup_s": lat, "short": short,
               "wrong": wrong, "faults": faults})


def _run(kind: str, role: str, target: str, nproc: int, prompts: int, block_kib: int, lookups: int
         ) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(nproc), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(kind, role, target, p, nproc, prompts, block_kib, lookups, barrier,
                                              queue)) for p in range(nproc)]
    for proc in procs:
        proc.start()
    rows = [queue.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0, f"{kind}/{role} process exited with {proc.exitcode}"
    w_span = max(r["w1"] for r in rows) - min(r["w0"] for r in rows)
    r_span = max(r["r1"] for r in rows) - min(r["r0"] for r in rows)
    per_proc = [r["written"] / (r["w1"] - r["w0"]) / 1e9 for r in rows]
    med = statistics.median(per_proc)
    lat = sorted(x for r in rows for x in r["lookup_s"])
    res = {"write_gbps": sum(r["written"] for r in rows) / w_span / 1e9,
           "read_gbps": sum(r["read"] for r in rows) / r_span / 1e9,
           "per_process_write_gbps": per_proc, "write_spread_min_over_max": min(per_proc) / max(per_proc),
           "starved": sum(x < STARVED_BELOW * med for x in per_proc),
           "short": sum(r["short"] for r in rows), "wrong": sum(r["wrong"] for r in rows),
           "faults": sum(r["faults"] for r in rows)}
    if lat:
        what = "lookup" if role == "tier" else "burst"
        res[f"{what}_p50_us"] = lat[len(lat) // 2] * 1e6
        res[f"{what}_p99_us"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6
    return res


def run(kinds: Sequence[str], counts: Sequence[int], mib: int, block_kib: int, lookups: int) -> dict[str, Any]:
    prompts = max(1, (mib << 10) // (block_kib * PROMPT_BLOCKS))
    results: dict[str, dict[str, Any]] = {}
    server = RedisServer(None, "--maxmemory", f"{2 * mib * max(counts) * 2 + 256}mb").start() \
        if "redis" in kinds else None
    try:
        for kind in kinds:
            for n in counts:
                got = {}
                for role in ("raw", "tier"):  # interleaved: each P's baseline just before its tier run
                    tmp = tempfile.mkdtemp(prefix="kvstrata-procs-") if kind == "disk" else ""
                    try:
                        got[role] = _run(kind, role, tmp if kind == "disk" else server.url if server else "",
                                         n, prompts, block_kib, lookups)
                    finally:
                        if tmp:
                            shutil.rmtree(tmp, ignore_errors=True)
                        if server is not None:
                            from tiers.remote.tier import connect
                            c = connect(server.url, timeout_s=30.0)
                            c.flushall()
                            c.close()
                t, r = got["tier"], got["raw"]
                results[f"{kind}/{n}"] = {"processes": n, "tier": t, "raw": r,
                                          "write_vs_raw": t["write_gbps"] / r["write_gbps"],
                                          "read_vs_raw": t["read_gbps"] / r["read_gbps"]}
                print(f"  {kind}/{n}: {results[f'{kind}/{n}']}", flush=True)
    finally:
        if server is not None:
            server.stop()
    for kind in kinds:
        one = results[f"{kind}/{min(counts)}"]["tier"]["lookup_p99_us"]
        for n in counts:
            res = results[f"{kind}/{n}"]
            res["lookup_p99_vs_one_process"] = res["tier"]["lookup_p99_us"] / one
            res["lookup_p99_vs_burst"] = res["tier"]["lookup_p99_us"] / res["raw"]["burst_p99_us"]
            res["goals_met"] = {"aggregate_vs_raw": min(res["write_vs_raw"], res["read_vs_raw"]) >= GOAL_VS_RAW,
                                "lookup_p99": res["lookup_p99_vs_one_process"] <= GOAL_P99_RATIO,
                                "no_writer_starved": res["tier"]["starved"] == 0}
    rows = [[k, r["tier"]["write_gbps"], r["raw"]["write_gbps"], r["write_vs_raw"], r["tier"]["read_gbps"],
             r["raw"]["read_gbps"], r["read_vs_raw"], r["tier"]["lookup_p50_us"], r["tier"]["lookup_p99_us"],
             r["lookup_p99_vs_one_process"], r["raw"]["burst_p99_us"], r["lookup_p99_vs_burst"],
             r["tier"]["write_spread_min_over_max"], r["tier"]["short"],
             r["tier"]["faults"], r["tier"]["wrong"]]
            for k, r in results.items()]
    print_table(f"Processes on one host ({block_kib} KiB blocks, {mib} MiB stored per process)",
                ["tier/procs", "store GB/s", "raw GB/s", "ratio", "read GB/s", "raw GB/s", "ratio", "lookup p50 us",
                 "p99 us", "p99 vs 1", f"{BURST_US} us burst p99", "p99 vs burst", "write min/max", "short", "faults",
                 "wrong"], rows)
    return {"block_kib": block_kib, "mib_per_process": mib, "prompt_blocks": PROMPT_BLOCKS,
            "goals": {"vs_raw": GOAL_VS_RAW, "lookup_p99_ratio": GOAL_P99_RATIO}, "burst_us": BURST_US,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(), "results": results}


@click.command("procs", help=__doc__, context_settings=CONTEXT)
@click.option("--tier", "kinds", type=click.Choice(["disk", "redis"]), multiple=True, default=("disk", "redis"),
              show_default=True)
@click.option("--procs", "counts", type=click.IntRange(min=1, max=64), multiple=True, default=(1, 2, 4, 8),
              show_default=True)
@click.option("--mib", type=click.IntRange(min=1), default=32, show_default=True, help="MiB stored per process.")
@click.option("--block-kib", type=click.IntRange(min=64), default=1024, show_default=True)
@click.option("--lookups", type=click.IntRange(min=1), default=1000, show_default=True)
def command(kinds: tuple[str, ...], counts: tuple[int, ...], mib: int, block_kib: int, lookups: int) -> None:
    write_results("procs", run(kinds, sorted(counts), mib, block_kib, lookups))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench procs")
