"""The raw LMDB floor under the disk tier's store: what py-lmdb alone costs per put and per
delete in an environment of N entries, keyed at random (like the tier's `index`: namespace
tag + 16-byte block hash) or by increasing big-endian 8-byte ticks (like `order`, and like a
"format 3" would key its entries). No kvstrata code: the environment's flags and the
transaction shape are copied from `tiers/disk/env.py` and `tiers/disk/batch.py`.

For each N: fill in transactions of 2,048 puts (the fill's average cost per block is the
tier's "store" column), then time, best of 5 transactions each, CPU (process time) and wall
per block of 2,048 more puts in one transaction ("put") and of an "evicting" transaction:
delete 2,048 entries (increasing: the lowest ticks; random: 2,048 random existing keys)
plus 2,048 puts (each also with its commit's share), and of 2,048 gets in a read
transaction. Baselines of the same run: the smallest N and the increasing keys. The
environment lives in a scratch directory under `--dir`, deleted after each N; 10^7 is
skipped, with a note, where under 12 GiB are free. Table to stdout; JSON to
results/lmdb_floor_<time>.json and `--out`.

    nice -n 5 python scripts/lmdb_floor.py --sizes 100000,1000000,10000000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lmdb
import numpy as np

BATCH = 2048  # blocks one store() call writes (bench.scale.BATCH_BLOCKS)
TAG = b"kvstrata"  # 8-byte namespace tag (tiers.disk.index.TAG_BYTES)
# tiers/disk/index.py `_ENTRY` header (60 B) + parent hash (16 B) + 16 uint32 token ids (64 B)
VALUE_BYTES = 60 + 16 + 64
ROUNDS = 5
MAP_BYTES = 1 << 40  # sparse; far beyond what 10^7 entries need
MIN_FREE_10M = 12 << 30
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each element: a bijection, so key i is regenerable and unique."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _M
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M
        out: np.ndarray = z ^ (z >> np.uint64(31))
        return out


def random_keys(ids: np.ndarray) -> list[bytes]:
    """Tag + 16 pseudo-random bytes for each id (like the tier's `index` keys)."""
    ids = ids.astype(np.uint64)
    raw = np.stack([_mix(ids * np.uint64(2)), _mix(ids * np.uint64(2) + np.uint64(1))], axis=1).tobytes()
    return [TAG + raw[i : i + 16] for i in range(0, len(raw), 16)]


def tick_keys(ids: np.ndarray) -> list[bytes]:
    """Big-endian 8-byte ticks (like the tier's `order` keys)."""
    raw = ids.astype(">u8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def open_env(path: str) -> tuple[lmdb.Environment, Any]:
    """The tier's flags (tiers/disk/env.py acquire_env) with the bench's durability `none`."""
    env = lmdb.open(path, map_size=MAP_BYTES, max_dbs=8, max_readers=1024, sync=False, metasync=False,
                    readahead=True, meminit=False, lock=True)
    return env, env.open_db(b"index")


def timed(fn: Callable[..., None], *args: Any) -> tuple[float, float]:
    """(wall s, CPU s) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - w, time.process_time() - c


class Floor:
    """One environment of N entries under one key kind; ids 0..next-1 were put, `gone` deleted."""

    def __init__(self, path: str, kind: str, value: bytes) -> None:
        self.env, self.db = open_env(path)
        self.keys = random_keys if kind == "random" else tick_keys
        self.kind, self.value, self.next, self.low = kind, value, 0, 0
        self.gone: set[int] = set()
        self.commit_cost = (0.0, 0.0)
        self.rng = np.random.default_rng(7)

    def put_txn(self, keys: list[bytes], drop: list[bytes]) -> None:
        """One write transaction: delete `drop`, put `keys`; its commit's cost in `commit_cost`."""
        txn = self.env.begin(write=True, db=self.db)
        try:
            for key in drop:
                if not txn.delete(key):
                    raise AssertionError("a key to delete was not there")
            for key in keys:
                txn.put(key, self.value)
        except BaseException:
            txn.abort()
            raise
        self.commit_cost = timed(txn.commit)

    def get_txn(self, keys: list[bytes]) -> None:
        with self.env.begin(db=self.db) as txn:
            for key in keys:
                if txn.get(key) is None:
                    raise AssertionError("a key to read was not there")

    def fresh(self) -> list[bytes]:
        ids = np.arange(self.next, self.next + BATCH)
        self.next += BATCH
        return self.keys(ids)

    def fill(self, n: int) -> tuple[float, float]:
        wall = cpu = 0.0
        while self.next < n:
            count = min(BATCH, n - self.next)
            keys = self.keys(np.arange(self.next, self.next + count))
            self.next += count
            w, c = timed(self.put_txn, keys, [])
            wall, cpu = wall + w, cpu + c
        return wall, cpu

    def victims(self) -> list[bytes]:
        if self.kind == "increasing":  # the lowest ticks, as `evict` walks `order` from its first
            ids = np.arange(self.low, self.low + BATCH)
            self.low += BATCH
            return self.keys(ids)
        return self.keys(self.live(mark_gone=True))

    def live(self, mark_gone: bool) -> np.ndarray:
        """2,048 distinct random ids of entries still held (`mark_gone`: about to be deleted)."""
        picked: set[int] = set()
        while len(picked) < BATCH:
            i = int(self.rng.integers(0, self.next))
            if i not in self.gone:
                picked.add(i)
        if mark_gone:
            self.gone |= picked
        return np.array(sorted(picked))

    def best(self, evicting: bool) -> dict[str, float]:
        """Best of ROUNDS transactions: µs per block stored, wall and CPU."""
        walls, cpus, commits = [], [], []
        for _ in range(ROUNDS):
            drop = self.victims() if evicting else []  # (before `fresh`: only keys already put)
            w, c = timed(self.put_txn, self.fresh(), drop)
            walls.append(w)
            cpus.append(c)
            commits.append(self.commit_cost[1])
        best = cpus.index(min(cpus))
        return {"wall_us": min(walls) / BATCH * 1e6, "cpu_us": cpus[best] / BATCH * 1e6,
                "commit_cpu_us": commits[best] / BATCH * 1e6}

    def best_get(self) -> dict[str, float]:
        """Best of ROUNDS read transactions of 2,048 gets: random existing keys (random), or
        2,048 consecutive ticks from a random start (increasing: one prompt's entries)."""
        walls, cpus = [], []
        for _ in range(ROUNDS):
            if self.kind == "random":
                ids = self.rng.permutation(self.live(mark_gone=False))
            else:
                start = int(self.rng.integers(self.low, self.next - BATCH))
                ids = np.arange(start, start + BATCH)
            w, c = timed(self.get_txn, self.keys(ids))
            walls.append(w)
            cpus.append(c)
        return {"wall_us": min(walls) / BATCH * 1e6, "cpu_us": min(cpus) / BATCH * 1e6}


def measure(root: str, n: int, kind: str, value: bytes) -> dict[str, Any]:
    path = tempfile.mkdtemp(prefix=f"lmdb_floor_{kind}_{n}_", dir=root)
    try:
        floor = Floor(path, kind, value)
        fill_wall, fill_cpu = floor.fill(n)
        put, evict, get = floor.best(False), floor.best(True), floor.best_get()
        with floor.env.begin() as txn:
            stat = txn.stat(floor.db)
        info = floor.env.info()
        floor.env.close()
        file_bytes = os.path.getsize(os.path.join(path, "data.mdb"))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"blocks": n, "keys": kind, "fill_wall_us": fill_wall / n * 1e6, "fill_cpu_us": fill_cpu / n * 1e6,
            "put": put, "evicting": evict, "get": get, "depth": stat["depth"], "leaf_pages": stat["leaf_pages"],
            "bytes_per_entry": (info["last_pgno"] + 1) * stat["psize"] / n, "file_bytes": file_bytes}


def _cpu(r: dict[str, Any]) -> dict[str, float]:
    """A row's CPU µs per block of each measurement."""
    return {"fill": r["fill_cpu_us"], "put": r["put"]["cpu_us"], "evicting": r["evicting"]["cpu_us"],
            "get": r["get"]["cpu_us"]}


def _over(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    ca, cb = _cpu(a), _cpu(b)
    return {m: ca[m] / cb[m] for m in ca}


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each key kind's CPU at every N over its smallest N's, and random over increasing."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("random", "increasing"):
        mine = [r for r in rows if r["keys"] == kind]
        for r in mine[1:]:
            out[f"{kind}_{r['blocks']}_vs_{mine[0]['blocks']}"] = _over(r, mine[0])
    for r in rows:
        inc = [x for x in rows if x["keys"] == "increasing" and x["blocks"] == r["blocks"]]
        if r["keys"] == "random" and inc:
            out[f"random_vs_increasing_{r['blocks']}"] = _over(r, inc[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,1000000,10000000", help="comma-separated entry counts")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory (the 10^7 env is ~3-4 GB)")
    ap.add_argument("--out", default="docs/data/lmdb_floor.json")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    value = np.random.default_rng(3).bytes(VALUE_BYTES)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    print(f"{'N':>10} {'keys':>10} {'fill CPU':>9} {'put wall (CPU; commit)':>24} "
          f"{'evicting wall (CPU; commit)':>28} {'get wall (CPU)':>16} {'depth':>5} {'B/entry':>7}  (µs per block)",
          flush=True)
    for n in sizes:
        free = shutil.disk_usage(args.dir).free
        if n >= 10_000_000 and free < MIN_FREE_10M:
            notes.append(f"{n} skipped: {free / 2**30:.1f} GiB free in {args.dir}, under 12 GiB")
            print(notes[-1], flush=True)
            continue
        for kind in ("random", "increasing"):
            r = measure(args.dir, n, kind, value)
            rows.append(r)
            cols = [f"{r[m]['wall_us']:>7.2f} ({r[m]['cpu_us']:>6.2f}; {r[m]['commit_cpu_us']:>5.2f})"
                    for m in ("put", "evicting")]
            print(f"{n:>10} {kind:>10} {r['fill_cpu_us']:>9.2f} {cols[0]:>24} {cols[1]:>28} "
                  f"{r['get']['wall_us']:>7.2f} ({r['get']['cpu_us']:>6.2f}) {r['depth']:>5} "
                  f"{r['bytes_per_entry']:>7.0f}", flush=True)
    table = ratios(rows) if rows else {}
    result: dict[str, Any] = {
        "what": "raw py-lmdb put / delete+put / get per block, random vs increasing keys (scripts/lmdb_floor.py)",
        "batch": BATCH, "value_bytes": VALUE_BYTES, "rounds_best_of": ROUNDS, "lmdb": lmdb.version(),
        "load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows, "ratios_cpu": table, "notes": notes}
    for k, v in table.items():
        print(f"{k}: " + ", ".join(f"{m} {x:.2f}x" for m, x in v.items()))
    os.makedirs("results", exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    for path in (f"results/lmdb_floor_{stamp}.json", args.out):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
