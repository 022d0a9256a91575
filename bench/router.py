"""Router scale: index memory per block, and lookup latency, at 10^6 blocks x 8 instances.

Run: `kvstrata bench router [--blocks N] [--instances K]`. Builds the router's index as
events would (each of K instances holds N blocks) in two layouts: *shared* (every instance
holds the same N blocks: N entries, K bits each) and *disjoint* (K x N entries). Reports the
resident memory per entry, then the server time of a lookup of a `--query-tokens` prompt
whose prefix one instance holds entirely, against the in-run baselines it cannot beat:
hashing the prompt's blocks, and K plain dict probes per block. Finally the same lookups
through real HTTP (aiohttp on loopback), with the server time the router reports.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import urllib.request
from collections.abc import Callable

import click
import numpy as np

from cli.args import CONTEXT, invoke, nonneg, positive
from cli.output import print_table, write_results
from cli.progress import tqdm
from router.decode import Stored
from router.fleet import FleetView, Limits
from router.index import KVIndex
from router.keys import chain
from router.lookup import Chooser, Scoring, parse_query


def _rss() -> int:
    """Resident bytes of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _time_each(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def build_fleet(num_blocks: int, instances: int, shared: bool, block_size: int) -> FleetView:
    """A fleet view whose instances each hold `num_blocks` random blocks in the CPU tier
    (written into the index directly: the event path is measured by the tests, not here)."""
    fleet = FleetView(Limits(stale_after_s=600, max_blocks_per_slot=max(num_blocks, 1) * 2))
    rng = np.random.default_rng(0)
    common = rng.integers(1, 2**63, size=num_blocks, dtype=np.int64).tolist() if shared else None
    for i in range(instances):
        src = fleet.add(f"tcp://127.0.0.1:{20000 + i}", f"engine-{i}")
        src.last_seen, src.block_size = 1e12, block_size  # alive for the whole run
        keys = common if shared else rng.integers(1, 2**63, size=num_blocks, dtype=np.int64).tolist()
        fleet.index.add(src.slot.index, 1, keys)
    return fleet


def via_events(num_blocks: int, block_size: int) -> dict[str, float]:
    """One source announcing `num_blocks` blocks (chains of 64) as decoded `BlockStored`
    events: resident bytes per block (index + the source's chain map) and apply time per
    block, against writing the same number of keys into the index directly."""
    fleet = FleetView(Limits(max_blocks_per_slot=num_blocks + 1))
    src = fleet.add("tcp://127.0.0.1:1", "events")
    rng = np.random.default_rng(2)
    chains = [Stored(tuple(range(i, i + 64)), None, rng.integers(0, 128_000, size=64 * block_size).astype("<u4"),
                     block_size, "CPU", None, None, None) for i in range(0, num_blocks, 64)]
    gc.collect()
    before = _rss()
    t0 = time.perf_counter()
    fleet.apply(src, list(chains))
    apply_s = time.perf_counter() - t0
    gc.collect()
    used = _rss() - before
    direct = KVIndex()
    t0 = time.perf_counter()
    direct.add(0, 1, range(len(chains) * 64))
    direct_s = time.perf_counter() - t0
    n = len(chains) * 64
    return {"blocks": n, "bytes_per_block": used / n, "apply_us_per_block": apply_s / n * 1e6,
            "index_add_us_per_block": direct_s / n * 1e6}


def run(num_blocks: int, instances: int, lookups: int, query_tokens: int, block_size: int,
        http_lookups: int) -> dict[str, object]:
    memory_rows, memory = [], {}
    fleet: FleetView | None = None
    for layout in tqdm(("disjoint", "shared"), desc="building the index", leave=False, disable=None):
        fleet = None
        gc.collect()
        before = _rss()
        fleet = build_fleet(num_blocks, instances, layout == "shared", block_size)
        gc.collect()
        used = _rss() - before
        entries = len(fleet.index)
        memory[layout] = {"entries": entries, "bytes": used, "bytes_per_entry": used / entries,
                          "bytes_per_block_instance": used / (num_blocks * instances)}
        memory_rows.append([layout, entries, used / 2**20, used / entries, used / (num_blocks * instances)])
    print_table(f"Router index: {instances} instances x {num_blocks:,} blocks each (resident memory)",
                ["layout", "entries", "MiB", "B/entry", "B/(block x instance)"], memory_rows)
    events = via_events(min(num_blocks, 1 << 18), block_size)
    print_table(f"One source announcing {events['blocks']:,} blocks through events (chains of 64)",
                ["B/block (index + chain map)", "apply us/block", "index.add us/block (baseline)", "x baseline"],
                [[events["bytes_per_block"], events["apply_us_per_block"], events["index_add_us_per_block"],
                  events["apply_us_per_block"] / events["index_add_us_per_block"]]])
    memory["via_events"] = events
    assert fleet is not None  # the shared layout, kept for the lookups

    # One instance holds the whole query prefix (in the pool tier); the rest hold nothing of it.
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128_000, size=query_tokens).tolist()
    arr = np.asarray(tokens, dtype="<u4")
    keys = chain(arr, block_size)
    fleet.index.add(fleet.sources["tcp://127.0.0.1:20000"].slot.index, 0, keys)
    chooser = Chooser(fleet, Scoring())
    query = parse_query({"token_ids": tokens})
    answer = chooser.answer(query)
    matched = answer["instances"]["engine-0"]["matched_tokens"]
    assert answer["best"] == "engine-0" and matched == len(keys) * block_size
    digests = keys
    probe_dict = fleet.index._blocks  # the same dict: probes of the same keys, K per block

    def probes() -> None:
        for _ in range(instances):
            for k in keys:
                probe_dict.get(k)

    rows, timings = [], {}
    for name, fn in (("hash the prompt", lambda: chain(arr, block_size)),
                     (f"{instances} dict probes per block", probes),
                     ("lookup (validate + hash + match + score)",
                      lambda: chooser.answer(parse_query({"token_ids": tokens})))):
        for _ in range(20):
            fn()  # warm up
        med, p99 = _percentiles(_time_each(fn, lookups))
        timings[name] = {"median_us": med * 1e6, "p99_us": p99 * 1e6}
    base = timings["hash the prompt"]["median_us"]
    for name, t in timings.items():
        rows.append([name, t["median_us"], t["p99_us"], t["median_us"] / base])
    http = _http(fleet, tokens, http_lookups)
    if http:
        rows.append(["HTTP round trip (client)", http["client_median_us"], http["client_p99_us"],
                     http["client_median_us"] / base])
        rows.append(["HTTP server time (reported)", http["server_median_us"], http["server_p99_us"],
                     http["server_median_us"] / base])
    print_table(f"Lookup of a {query_tokens}-token prompt ({len(digests)} blocks) over {instances} instances, "
                f"{len(fleet.index):,} indexed blocks", ["what", "median us", "p99 us", "x hashing"], rows)
    return {"num_blocks": num_blocks, "instances": instances, "block_size": block_size,
            "query_tokens": query_tokens, "memory": memory, "lookup": timings, "http": http}


def _http(fleet: FleetView, tokens: list[int], n: int) -> dict[str, float]:
    """Lookups through the real HTTP service over the same index."""
    if n == 0:
        return {}
    from router.config import RouterConfig
    from router.thread import RouterThread

    server = RouterThread(RouterConfig())
    server.router.fleet = fleet
    server.router.chooser = Chooser(fleet, Scoring())
    body = json.dumps({"token_ids": tokens}).encode()
    client, reported = [], []
    try:
        for i in range(n + 20):
            req = urllib.request.Request(server.url + "/lookup", data=body, method="POST")
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=10) as resp:
                answer = json.loads(resp.read())
            if i >= 20:
                client.append(time.perf_counter() - t0)
                reported.append(answer["server_time_us"] / 1e6)
    finally:
        server.stop()
    cm, cp = _percentiles(client)
    sm, sp = _percentiles(reported)
    return {"client_median_us": cm * 1e6, "client_p99_us": cp * 1e6, "server_median_us": sm * 1e6,
            "server_p99_us": sp * 1e6}


@click.command("router", help=__doc__, context_settings=CONTEXT)
@click.option("--blocks", type=positive(), default=1_000_000, show_default=True, help="blocks each instance holds")
@click.option("--instances", type=positive(), default=8, show_default=True)
@click.option("--lookups", type=positive(), default=2000, show_default=True)
@click.option("--http-lookups", type=nonneg(), default=500, show_default=True, help="lookups through HTTP (0: skip)")
@click.option("--query-tokens", type=positive(), default=1024, show_default=True)
@click.option("--block-size", type=positive(), default=16, show_default=True)
def command(blocks: int, instances: int, lookups: int, http_lookups: int, query_tokens: int, block_size: int) -> None:
    write_results("router", run(blocks, instances, lookups, query_tokens, block_size, http_lookups))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench router")
