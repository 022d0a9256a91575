"""`kvstrata bench soak`: many clients against every tier for a long time while faults land at
random moments, every answer checked; ends with a line `wrong bytes: N` (N blocks).

Engine processes (`--clients`, each with `--threads` threads; `bench/soak_client.py`) share
one small disk tier and one `redis-server` (the last engine a 3-master cluster instead), so
every tier evicts and demotes all the time, and check every hit bit-exact. A durability
probe stores with `disk_sync="commit"` and, after each `kill -9`, reads back every prompt it
acknowledged. Faults, at random moments drawn from `--seed`: `kill -9` of an engine process
(restarted on the same disk) or of the probe (which then verifies); `SIGSTOP`/`SIGCONT` of
the server or of a cluster node; a restart of the server (with or without its append-only
file, switched at random: its blocks come back or are gone) or of a node; a server that
fills up (`noeviction` at a small `maxmemory` for a while); bit rot in the disk tier's slot
files and in remote records; a link (a proxy between the engines and the server) that turns
slow or drops every connection. Exits 1 if a block came back wrong, a durable block was
lost, a raw exception left the store, a call ran past its bound, or the store's counters
disagree with its calls; the same seed draws the same workload and sequence of faults.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import click

from bench.soak_faults import Soak
from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results


def summarize(stats_files: list[str], seconds: float) -> dict[str, Any]:
    """Every process's last figures, added up."""
    ops: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    samples: dict[str, list[float]] = {}
    total = {"wrong_blocks": 0, "late": 0, "checked_blocks": 0, "lost_blocks": 0, "verified_blocks": 0,
             "counter_mismatches": 0}
    tier_faults: Counter[str] = Counter()
    growth = {"rss_bytes": 0, "fds": 0, "threads": 0}
    for path in stats_files:
        try:
            s = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue  # killed before its first report
        ops.update(s["ops"])
        hits.update(s["hit_tokens"])
        errors.update(s["errors"])
        for k in total:
            total[k] += s.get(k, 0)
        for op, xs in s["samples"].items():
            samples.setdefault(op, []).extend(xs)
        if s["start"]["rss_bytes"]:
            for k in growth:
                growth[k] = max(growth[k], s["now"][k] - s["start"][k])
        errors.update({k: v for k, v in s.items() if k.startswith("error_")})
        for name in ("tier_corrupt", "tier_errors"):  # an engine's last word, if it finished
            tier_faults.update({f"{name[5:]}_{k}": v for k, v in s.get("counters", {}).get(name, {}).items()})
        if s.get("counters", {}).get("off"):
            print(f"kvstrata bench soak: counters off in {path}: {s['counters']['off']}", file=sys.stderr)
    latency = {op: {"p50_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * sorted(xs)[int(0.99 * (len(xs) - 1))],
                    "max_ms": 1e3 * max(xs), "count": ops[op]} for op, xs in sorted(samples.items()) if xs}
    return {"ops": dict(ops), "hit_tokens": dict(hits), "ops_per_s": sum(ops.values()) / seconds,
            "errors": dict(errors), **total, "latency": latency, "growth": growth, "tier_faults": dict(tier_faults)}


def run(minutes: float, seed: int, clients: int, threads: int, remote: bool, cluster: bool, faults: bool) -> int:
    seconds = minutes * 60
    # SIGTERM ends the soak as Ctrl-C does: through its cleanup (no engine or server left behind)
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with tempfile.TemporaryDirectory(prefix="kvstrata-soak-") as tmp:
            soak = Soak(Path(tmp), seed, clients, threads, seconds, remote, cluster)
            soak.run(faults)
            result = summarize(soak.stats, seconds)
    finally:
        signal.signal(signal.SIGTERM, before)
    raw = {k: v for k, v in result["errors"].items() if not k.startswith("error_")}
    print_table(f"soak, {minutes:g} min, seed {seed}: {clients} engines x {threads} threads + durability probe",
                ["operation", "count", "tokens hit", "p50 ms", "p99 ms", "max ms"],
                [[op, r["count"], result["hit_tokens"].get(op, 0), r["p50_ms"], r["p99_ms"], r["max_ms"]]
                 for op, r in result["latency"].items()])
    print_table("faults injected", ["fault", "count"], sorted(soak.faults.items()))
    print(f"\noperations per second: {result['ops_per_s']:.0f}; blocks checked: {result['checked_blocks']}; "
          f"durable blocks verified: {result['verified_blocks']}")
    print(f"growth after warm-up (max per process): RSS {result['growth']['rss_bytes'] >> 10} KiB, "
          f"fds {result['growth']['fds']}, threads {result['growth']['threads']}")
    print(f"counted misses by kind: {dict((k, v) for k, v in result['errors'].items() if k.startswith('error_'))}")
    print(f"raw exceptions: {sum(raw.values())} {raw if raw else ''}")
    print(f"calls past {10:g} s: {result['late']}")
    print(f"faults the tiers counted (engines that finished): {result['tier_faults']}")
    print(f"counter mismatches: {result['counter_mismatches']}")
    print(f"prompts the router still disagreed on with engine 0 after 60 s: {len(soak.router_off)} "
          f"{dict(list(soak.router_off.items())[:5]) if soak.router_off else ''}")
    print(f"durable blocks lost: {result['lost_blocks']}")
    print(f"wrong bytes: {result['wrong_blocks']}")
    write_results("soak", {"minutes": minutes, "seed": seed, "clients": clients, "threads": threads,
                           "faults": dict(soak.faults), "fault_log": soak.log, "router_disagreed": soak.router_off,
                           "disk_tmpfs": soak.tmpfs, **result})
    bad = (result["wrong_blocks"] or result["lost_blocks"] or raw or result["late"] or soak.faults["hung_at_end"]
           or result["counter_mismatches"] or soak.router_off)
    died = sum(v for k, v in soak.faults.items() if k.startswith("died_by_itself"))
    return 1 if bad or died else 0


@click.command("soak", help=__doc__, context_settings=CONTEXT)
@click.option("--minutes", type=click.FloatRange(min=0.2), default=60.0, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="draws the workload and the faults")
@click.option("--clients", type=click.IntRange(1, 64), default=3, show_default=True, help="engine processes")
@click.option("--threads", type=click.IntRange(1, 64), default=3, show_default=True, help="threads per engine")
@click.option("--remote/--no-remote", default=True, show_default=True, help="a redis-server as the remote tier")
@click.option("--cluster/--no-cluster", default=True, show_default=True,
              help="the last engine's remote tier a 3-master redis cluster (with --remote and 2+ clients)")
@click.option("--faults/--no-faults", default=True, show_default=True)
def command(minutes: float, seed: int, clients: int, threads: int, remote: bool, cluster: bool, faults: bool) -> int:
    return run(minutes, seed, clients, threads, remote, cluster, faults)


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench soak")
