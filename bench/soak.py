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
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click

from bench.soak_proxy import FaultyLink
from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results

FAULTS = ("kill_engine", "kill_probe", "server_pause", "server_restart", "server_full", "disk_rot", "remote_rot",
          "link_slow", "link_drop", "server_persistence", "cluster_node_pause", "cluster_node_restart")


class Soak:
    """The processes of one soak and the faults it injects."""

    def __init__(self, workdir: Path, seed: int, clients: int, threads: int, seconds: float, remote: bool,
                 cluster: bool) -> None:
        self.dir, self.seed, self.seconds = workdir, seed, seconds
        self.rng = random.Random(seed)
        self.end = time.monotonic() + seconds
        self.server = None
        if remote:
            from cli.redis_servers import RedisServer

            self.server = RedisServer(None, "--maxmemory", "16mb").start()
            self.link = FaultyLink(self.server.port)  # the engines reach the server through it
        url = f"redis://127.0.0.1:{self.link.port}" if self.server else None
        self.specs = [{"mode": "engine", "index": i, "seed": seed, "threads": threads, "cpu_blocks": 48,
                       "disk": str(workdir / "disk"), "disk_bytes": 3 << 20, "remote_url": url} for i in range(clients)]
        self.cluster = None
        if remote and cluster and clients >= 2:  # the last engine's remote tier is a 3-master cluster
            from cli.redis_servers import RedisCluster

            self.cluster = RedisCluster(3).start()
            self.specs[-1]["remote_url"] = self.cluster.url
        self.specs.append({"mode": "durable", "index": clients, "seed": seed, "disk": str(workdir / "durable"),
                           "acks": str(workdir / "durable.acks")})
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(self.specs)
        self.stats: list[str] = []  # every process's stats file, restarts included
        self.faults: Counter[str] = Counter()
        self.log: list[tuple[float, str]] = []

    def start(self, i: int) -> None:
        """Start process `i` (again) with the time left and a stats file of its own."""
        spec = dict(self.specs[i], seconds=max(1.0, self.end - time.monotonic()),
                    stats=str(self.dir / f"stats-{i}-{len(self.stats)}.json"))
        self.stats.append(spec["stats"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                        os.environ.get("PYTHONPATH")]))}
        with (self.dir / f"stderr-{i}.log").open("ab") as err:  # the child keeps its own copy
            self.procs[i] = subprocess.Popen([sys.executable, "-m", "bench.soak_client", json.dumps(spec)], env=env,
                                             stdout=subprocess.DEVNULL, stderr=err)

    def inject(self, fault: str) -> None:
        """One fault now; counted by kind."""
        self.faults[fault] += 1
        self.log.append((round(self.seconds - (self.end - time.monotonic()), 1), fault))
        if fault in ("kill_engine", "kill_probe"):
            i = len(self.specs) - 1 if fault == "kill_probe" else self.rng.randrange(len(self.specs) - 1)
            proc = self.procs[i]
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            self.start(i)
        elif fault == "server_pause" and self.server and self.server.proc:
            self.server.proc.send_signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(0.2, 2.5))
            self.server.proc.send_signal(signal.SIGCONT)
        elif fault == "server_restart" and self.server:
            self.server.kill()
            time.sleep(self.rng.uniform(0.1, 1.0))
            self.server.start()
        elif fault == "server_full" and self.server:
            self._redis("CONFIG", "SET", "maxmemory-policy", "noeviction")
            self._redis("CONFIG", "SET", "maxmemory", "2mb")
            time.sleep(self.rng.uniform(0.5, 3.0))
            self._redis("CONFIG", "SET", "maxmemory", "16mb")
            self._redis("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        elif fault == "server_persistence" and self.server:  # the next restart keeps its blocks, or not
            on = self.rng.choice(["yes", "no"])
            self._redis("CONFIG", "SET", "appendonly", on)
            self.server.extra = ("--maxmemory", "16mb", "--appendonly", on)
        elif fault == "cluster_node_pause" and self.cluster:
            node = self.rng.choice(self.cluster.servers)
            if node.proc is not None:
                node.proc.send_signal(signal.SIGSTOP)
                time.sleep(self.rng.uniform(0.2, 2.5))  # past 1 s the others mark it failed: the cluster is down
                node.proc.send_signal(signal.SIGCONT)
        elif fault == "cluster_node_restart" and self.cluster:
            node = self.rng.choice(self.cluster.servers)
            node.kill()
            time.sleep(self.rng.uniform(0.1, 1.0))
            node.start()  # its nodes.conf brings it back into the cluster; its blocks are gone
        elif fault == "link_slow" and self.server:
            self.link.slow(self.rng.uniform(1.0, 4.0), self.rng.uniform(0.05, 0.5))
        elif fault == "link_drop" and self.server:
            self.link.drop()
        elif fault == "disk_rot":
            files = [p for p in (self.dir / "disk").rglob("*") if p.is_file() and "slot" in p.name and p.stat().st_size]
            if files:
                _flip(self.rng.choice(files), self.rng)
        elif fault == "remote_rot" and self.server:
            self._remote_rot()

    def _redis(self, *args: str) -> Any:
        import redis

        try:
            return redis.Redis(port=self.server.port, socket_timeout=2).execute_command(*args)  # type: ignore[union-attr]
        except redis.RedisError:
            return None  # the server is down or paused right now: the fault did less

    def _remote_rot(self) -> None:
        import redis

        try:
            client = redis.Redis(port=self.server.port, socket_timeout=2)  # type: ignore[union-attr]
            keys = client.scan(self.rng.randrange(1 << 16), count=50)[1]
            if keys:
                key = self.rng.choice(keys)
                size = client.strlen(key)
                if size:
                    at = self.rng.randrange(size)
                    old = client.getrange(key, at, at)
                    client.setrange(key, at, bytes([old[0] ^ (1 << self.rng.randrange(8))]) if old else b"\x00")
        except redis.RedisError:
            pass

    def run(self, faults: bool) -> None:
        for i in range(len(self.specs)):
            self.start(i)
        next_fault = time.monotonic() + self.rng.expovariate(1 / 3.0)
        deck: list[str] = []
        while time.monotonic() < self.end:
            for i, proc in enumerate(self.procs):  # an engine that died by itself is a defect: shown, restarted
                if proc is not None and proc.poll() not in (None, 0):
                    self.faults[f"died_by_itself_{self.specs[i]['mode']}"] += 1
                    tail = (self.dir / f"stderr-{i}.log").read_text(errors="replace")[-2000:]
                    print(f"kvstrata bench soak: process {i} died by itself:\n{tail}", file=sys.stderr)
                    self.start(i)
            if faults and time.monotonic() >= next_fault and time.monotonic() < self.end - 5:
                if not deck:  # every kind once per round, in a random order: each lands, even in a short soak
                    deck = self.rng.sample(FAULTS, len(FAULTS))
                self.inject(deck.pop())
                next_fault = time.monotonic() + self.rng.expovariate(1 / 3.0)
            time.sleep(0.1)
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:  # a hang: killed, counted
                    self.faults["hung_at_end"] += 1
                    proc.kill()
        self.end = time.monotonic() + 1.0  # a last start of the probe: it verifies every acknowledged prompt
        self.start(len(self.specs) - 1)
        probe = self.procs[-1]
        try:
            probe.wait(timeout=120) if probe is not None else None
        except subprocess.TimeoutExpired:
            self.faults["hung_at_end"] += 1
            probe.kill()  # type: ignore[union-attr]
        if self.server:
            self.link.close()
            self.server.stop()
        if self.cluster:
            self.cluster.stop()


def _flip(path: Path, rng: random.Random) -> None:
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        at = rng.randrange(size)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))


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
    with tempfile.TemporaryDirectory(prefix="kvstrata-soak-") as tmp:
        soak = Soak(Path(tmp), seed, clients, threads, seconds, remote, cluster)
        soak.run(faults)
        result = summarize(soak.stats, seconds)
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
    print(f"durable blocks lost: {result['lost_blocks']}")
    print(f"wrong bytes: {result['wrong_blocks']}")
    write_results("soak", {"minutes": minutes, "seed": seed, "clients": clients, "threads": threads,
                           "faults": dict(soak.faults), "fault_log": soak.log, **result})
    bad = (result["wrong_blocks"] or result["lost_blocks"] or raw or result["late"] or soak.faults["hung_at_end"]
           or result["counter_mismatches"])
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
