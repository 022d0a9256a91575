"""One process of `kvstrata bench soak`: an engine's threads on a store, or the durability probe.

    python -m bench.soak_client '{"mode": "engine", ...}'

An engine process runs `threads` threads of a random mix of store, retrieve (both forms),
lookup, prefetch, the asyncio API and a rare clear, on prompts that share prefixes, under
two cache salts; it checks every hit bit-exact (`bench/soak_kv.py`). The durability probe
stores with `disk_sync="commit"` into a disk tier that never evicts and logs each
acknowledged prompt (fsynced); when started again (after a `kill -9`), it first reads back
every prompt it logged. Both write their figures to `stats` (JSON, replaced atomically every
second), so a killed process loses at most a second of figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.soak_kv import BLOCK, DOC_BLOCKS, LAYOUT, NUM_DOCS, SUFFIXES, make_kv, prompt, wrong_blocks
from kvstore import ExtraKeys, KVCacheStore, StoreConfig
from kvstore.errors import KVStoreError

LATE_S = 10.0  # an operation slower than this is counted late (every call's bound is below it)
SAMPLES = 4000  # latency samples kept per operation (a reservoir)
OPS = {"store": 30, "retrieve": 25, "retrieve_out": 10, "lookup": 15, "prefetch": 8, "astore": 5, "aretrieve": 5,
       "clear": 0.2}
SALTS = ("tenant-a", "tenant-b")


class Figures:
    """What a process did, thread-safe; `snapshot` is what goes to the stats file."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: dict[str, int] = defaultdict(int)
        self.hit_tokens: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, Any] = {"wrong_blocks": 0, "late": 0, "checked_blocks": 0}
        self.start = {"rss_bytes": 0, "fds": 0, "threads": 0}

    def add(self, op: str, seconds: float, hit: int = 0) -> None:
        with self.lock:
            self.ops[op] += 1
            self.hit_tokens[op] += hit
            self.extra["late"] += seconds > LATE_S
            s = self.samples[op]
            if len(s) < SAMPLES:
                s.append(seconds)
            else:
                s[random.randrange(self.ops[op]) % SAMPLES] = seconds

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.extra[name] = self.extra.get(name, 0) + n

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"ops": dict(self.ops), "hit_tokens": dict(self.hit_tokens), "errors": dict(self.errors),
                    "samples": {k: list(v) for k, v in self.samples.items()}, **self.extra,
                    "start": self.start, "now": _resources(), "time": time.time()}


def _resources() -> dict[str, int]:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {"rss_bytes": pages * os.sysconf("SC_PAGE_SIZE"), "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count()}


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)


def _engine_thread(store: KVCacheStore, figures: Figures, rng: random.Random, seed: int, deadline: float) -> None:
    names, weights = list(OPS), list(OPS.values())
    loop = asyncio.new_event_loop()
    out = torch.empty(LAYOUT.block_shape((DOC_BLOCKS + 4) * BLOCK), dtype=LAYOUT.dtype)  # the longest prompt
    while time.monotonic() < deadline:
        op = rng.choices(names, weights)[0]
        salt = rng.choice(SALTS)
        tokens = prompt(seed, min(int(rng.paretovariate(1.1)) - 1, NUM_DOCS - 1), rng.randrange(SUFFIXES))
        tag, extra = f"soak/{salt}", ExtraKeys(cache_salt=salt)
        t0 = time.monotonic()
        try:
            hit = _one(store, op, tokens, tag, extra, out, loop, figures)
        except KVStoreError as exc:  # documented: a full disk on store, a closed store
            figures.count(f"error_{type(exc).__name__}")
            continue
        except Exception as exc:  # a raw exception out of the store is a defect: counted, shown
            with figures.lock:
                figures.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
            continue
        figures.add(op, time.monotonic() - t0, hit)
    loop.close()


def _one(store: KVCacheStore, op: str, tokens: np.ndarray, tag: str, extra: ExtraKeys, out: torch.Tensor,
         loop: asyncio.AbstractEventLoop, figures: Figures) -> int:
    """Run `op` once; the tokens it hit (checked bit-exact where KV came back)."""
    if op in ("store", "astore"):
        kv = make_kv(tokens, tag)
        if op == "store":
            return store.store(tokens, kv, extra_keys=extra)
        return loop.run_until_complete(store.astore(tokens, kv, extra_keys=extra))
    if op == "lookup":
        n = store.lookup(tokens, extra_keys=extra)
        if n % BLOCK or n > len(tokens):
            figures.count("wrong_blocks")
        return n
    if op == "prefetch":
        return store.prefetch(tokens, extra_keys=extra).result(timeout=LATE_S * 3).num_in_memory * BLOCK
    if op == "clear":
        store.clear()
        return 0
    if op == "retrieve_out":
        got = store.retrieve(tokens, extra_keys=extra, out=out)
    elif op == "aretrieve":
        got = loop.run_until_complete(store.aretrieve(tokens, extra_keys=extra))
    else:
        got = store.retrieve(tokens, extra_keys=extra)
    figures.count("wrong_blocks", wrong_blocks(tokens, got.kv, got.num_tokens, tag))
    figures.count("checked_blocks", got.num_tokens // BLOCK)
    return got.num_tokens


def _check_counters(store: KVCacheStore, figures: Figures) -> None:
    """The store's own counters against what this process's calls did: every call counted once,
    every token a retrieve returned counted as hit (a clear resets no counter)."""
    st, snap = store.stats(), figures.snapshot()
    ops, hits = snap["ops"], snap["hit_tokens"]
    failed = sum(v for k, v in snap.items() if k.startswith("error_"))  # refused calls may count or not
    want = {"num_store_calls": ops.get("store", 0) + ops.get("astore", 0),
            "num_retrieve_calls": ops.get("retrieve", 0) + ops.get("retrieve_out", 0) + ops.get("aretrieve", 0),
            "num_tokens_hit": hits.get("retrieve", 0) + hits.get("retrieve_out", 0) + hits.get("aretrieve", 0)}
    got = {name: getattr(st, name) for name in want}
    off = {k: (got[k], v) for k, v in want.items() if not v <= got[k] <= v + failed * (k != "num_tokens_hit")}
    figures.count("counter_mismatches", len(off))
    with figures.lock:
        figures.extra["counters"] = {"store": got, "calls": want, "off": off,
                                     "tier_corrupt": {t.kind.value: t.num_corrupt for t in st.tiers},
                                     "tier_errors": {t.kind.value: t.num_errors for t in st.tiers}}


def _final_state(store: KVCacheStore, spec: dict[str, Any]) -> None:
    """Write what this store holds of every prompt (for the router to be held to), then stay
    open, publishing, until the soak says it is done (or 120 s)."""
    held = {f"{d}/{v}/{salt}": [prompt(spec["seed"], d, v).tolist(), salt, 0]
            for d in range(NUM_DOCS) for v in range(SUFFIXES) for salt in SALTS}
    for item in held.values():
        item[2] = store.lookup(item[0], extra_keys=ExtraKeys(cache_salt=item[1]))
    _write(spec["final"], held)
    deadline = time.monotonic() + 120
    while not Path(spec["final_done"]).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _durable(spec: dict[str, Any], figures: Figures, deadline: float) -> None:
    """Read back every acknowledged prompt, then store more, acknowledging each once it returns."""
    acks = Path(spec["acks"])
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, namespace="soak-durable", cpu_bytes=0, disk_path=spec["disk"],
                      disk_bytes=256 << 20, disk_sync="commit")
    with KVCacheStore(cfg) as store:
        done = set()
        for line in acks.read_text().splitlines() if acks.exists() else []:
            parts = line.split()
            if len(parts) != 3 or parts[2] != "ok":  # a torn last line: that ack never completed
                continue
            doc, variant = int(parts[0]), int(parts[1])
            tokens = prompt(spec["seed"], doc, variant)
            got = store.retrieve(tokens)
            figures.count("verified_blocks", len(tokens) // BLOCK)
            figures.count("lost_blocks", (len(tokens) - got.num_tokens) // BLOCK)
            figures.count("wrong_blocks", wrong_blocks(tokens, got.kv, got.num_tokens, "soak/durable"))
            done.add((doc, variant))
        with figures.lock:
            figures.extra["verified"] = True  # the soak kills a probe only once it has verified
        _write(spec["stats"], figures.snapshot())
        todo = [(d, v) for d in range(NUM_DOCS) for v in range(SUFFIXES) if (d, v) not in done]
        random.Random(spec["seed"] + len(done)).shuffle(todo)
        with acks.open("a") as log:
            for doc, variant in todo:
                if time.monotonic() >= deadline:
                    break
                tokens = prompt(spec["seed"], doc, variant)
                t0 = time.monotonic()
                n = store.store(tokens, make_kv(tokens, "soak/durable"))
                figures.add("store", time.monotonic() - t0, n)
                if n == len(tokens):
                    log.write(f"{doc} {variant} ok\n")
                    log.flush()
                    os.fsync(log.fileno())
                time.sleep(0.05)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    figures = Figures()
    deadline = time.monotonic() + spec["seconds"]
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(1.0):
            if not figures.start["rss_bytes"] and time.monotonic() > deadline - spec["seconds"] + 5:
                figures.start = _resources()  # after warm-up: growth is measured from here
            _write(spec["stats"], figures.snapshot())

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    if spec["mode"] == "durable":
        _durable(spec, figures, deadline)
    else:
        cfg = StoreConfig(LAYOUT, block_size=BLOCK, namespace="soak", cpu_bytes=spec["cpu_blocks"] * LAYOUT.block_bytes(
            BLOCK), disk_path=spec["disk"], disk_bytes=spec["disk_bytes"], remote_url=spec.get("remote_url"),
            remote_timeout_s=2.0, events_endpoint=spec.get("events_endpoint"), instance_id=spec.get("instance_id"))
        with KVCacheStore(cfg) as store:
            threads = [threading.Thread(target=_engine_thread, args=(store, figures, random.Random(
                spec["seed"] * 1000 + spec["index"] * 10 + i), spec["seed"], deadline)) for i in range(spec["threads"])]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            _check_counters(store, figures)
            if spec.get("final"):
                _final_state(store, spec)
    stop.set()
    _write(spec["stats"], {**figures.snapshot(), "finished": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
