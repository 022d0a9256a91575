"""The soak's processes and the faults it injects at random moments (`kvstrata bench soak`)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import child_env
from bench.soak_proxy import FaultyLink
from bench.soak_router import RouterWatch
from cli.ports import free_port_pair

FAULTS = ("kill_engine", "kill_probe", "server_pause", "server_restart", "server_full", "disk_rot", "remote_rot",
          "link_slow", "link_drop", "server_persistence", "cluster_node_pause", "cluster_node_restart",
          "router_restart", "disk_fill")
MEAN_FAULT_INTERVAL_S = 2.0  # between faults, exponentially distributed
TMPFS_BYTES = 8 << 20  # the shared disk tier's file system, when it can be mounted: filled up and freed again


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
        # Engine 0 keeps tiers of its own (CPU, a private disk) and publishes KV events for the router,
        # which must agree with it at the end (a shared tier's evictions are announced by no one).
        events_port = free_port_pair()
        self.specs[0].update(disk=str(workdir / "disk0"), remote_url=None, instance_id="engine-0",
                             events_endpoint=f"tcp://127.0.0.1:{events_port}", final=str(workdir / "final-0.json"),
                             final_done=str(workdir / "final-0.done"))
        self.router = RouterWatch(workdir, events_port)
        self.specs.append({"mode": "durable", "index": clients, "seed": seed, "disk": str(workdir / "durable"),
                           "acks": str(workdir / "durable.acks")})
        self.tmpfs = _mount_tmpfs(workdir / "disk")
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(self.specs)
        self.stats: list[str] = []  # every process's stats file, restarts included
        self._last_stats: dict[int, int] = {}  # process -> its current stats file (index into `stats`)
        self.faults: Counter[str] = Counter()
        self.log: list[tuple[float, str]] = []
        self.router_off: dict[str, list[int]] = {}  # prompts on which the router disagreed at the end

    def start(self, i: int) -> None:
        """Start process `i` (again) with the time left and a stats file of its own."""
        spec = dict(self.specs[i], seconds=max(1.0, self.end - time.monotonic()),
                    stats=str(self.dir / f"stats-{i}-{len(self.stats)}.json"))
        self._last_stats[i] = len(self.stats)
        self.stats.append(spec["stats"])
        env = child_env()
        with (self.dir / f"stderr-{i}.log").open("ab") as err:  # the child keeps its own copy
            self.procs[i] = subprocess.Popen([sys.executable, "-m", "bench.soak_client", json.dumps(spec)], env=env,
                                             stdout=subprocess.DEVNULL, stderr=err)

    def inject(self, fault: str) -> None:
        """One fault now; counted by kind."""
        if fault == "kill_probe" and not self._probe_verified():
            self.faults["kill_probe_deferred"] += 1  # each kill is followed by a whole verification
            return
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
        elif fault == "router_restart":
            self.router.kill()
            time.sleep(self.rng.uniform(0.1, 1.0))
            self.router.start()
        elif fault == "disk_fill" and self.tmpfs:
            filler = self.dir / "disk" / "soak-filler"  # ours: written until the file system is full, then removed
            try:
                with filler.open("wb") as f:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
            except OSError:
                pass
            time.sleep(self.rng.uniform(1.0, 3.0))
            filler.unlink(missing_ok=True)
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

    def _probe_verified(self) -> bool:
        """Whether the running probe has read back everything acknowledged before its start."""
        try:
            return bool(json.loads(Path(self.stats[self._last_stats[len(self.specs) - 1]]).read_text()).get("verified"))
        except (OSError, ValueError, KeyError, IndexError):
            return False

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
        """Run the soak to its end; whatever happens, every process it started is gone after."""
        try:
            self._run(faults)
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill what is still running, stop the servers and the router, unmount the tmpfs."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.router.stop()
        if self.server:
            self.link.close()
            self.server.stop()
        if self.cluster:
            self.cluster.stop()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.dir / "disk")], check=False)
            self.tmpfs = False

    def _run(self, faults: bool) -> None:
        for i in range(len(self.specs)):
            self.start(i)
        next_fault = time.monotonic() + self.rng.expovariate(1 / MEAN_FAULT_INTERVAL_S)
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
                fault = deck.pop()
                try:
                    self.inject(fault)
                except Exception as exc:  # e.g. a server that did not come back in time: counted, the soak goes on
                    self.faults[f"fault_failed_{fault}"] += 1
                    print(f"kvstrata bench soak: fault {fault} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                next_fault = time.monotonic() + self.rng.expovariate(1 / MEAN_FAULT_INTERVAL_S)
            time.sleep(0.1)
        self.router_off = self._router_agrees()
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

    def _router_agrees(self) -> dict[str, list[int]]:
        """Once engine 0 has written what it holds (after its last operation), the prompts on
        which the router still disagrees after 60 s; then lets engine 0 finish."""
        final, done = Path(self.specs[0]["final"]), Path(self.specs[0]["final_done"])
        deadline = time.monotonic() + 120
        while not final.exists() and time.monotonic() < deadline and self.procs[0] is not None \
                and self.procs[0].poll() is None:
            time.sleep(0.2)
        try:
            expected = {k: (v[0], v[1], v[2]) for k, v in json.loads(final.read_text()).items()}
            off = self.router.converge(expected, timeout_s=60)
        except (OSError, ValueError):
            off = {"engine 0 wrote no final state": [-1, -1]}
        done.touch()
        return off


def _mount_tmpfs(where: Path) -> bool:
    """A small tmpfs at `where` for the shared disk tier, or False where mounting is denied."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(where)],
                          capture_output=True, check=False)
    return done.returncode == 0


def _flip(path: Path, rng: random.Random) -> None:
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        at = rng.randrange(size)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
