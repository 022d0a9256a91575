"""Shared tiers (a shared directory, a Valkey/Redis server, ...) against a raw client of the same medium, in one run.

Run: `kvstrata bench shared-tiers [--tier JSON ...] [--sizes 2M,32M] [--mib N] [--repeat R]
[--workdir DIR]`. Each `--tier` is a tier config as JSON (`{"type": "sharedfs", "path":
"/mnt/kv"}`, `{"type": "remote", "url": "redis://..."}`); without one, a `sharedfs` tier in
`--workdir` and a `remote` tier on a `redis-server` the bench starts. A tier of type T is
compared with `BASELINES[T]`, the plain client a user would write for that medium, moving the
same bytes with the same number of threads: another shared tier is one entry there.

- `sharedfs`: one file per block, written to a temporary name and renamed, read whole, on a
  pool of the tier's `io_threads`; a lookup is one `os.stat` per key.
- `remote`: a redis-py pipeline of SET, then of GET, of values of the record's size; a lookup
  is a pipeline of EXISTS.

Per block size (2M: 16 tokens of a Llama-3-8B layout; 32M: 256 tokens), about `--mib` MiB of
KV is stored through a store whose only tier is the one measured (timed until `flush()`
returns) and retrieved into a caller's buffer (best of two, checked bit-exact); the baseline
moves the same number of values of the record's size. Lookup latency: p50/p99 of the
engine API's `lookup` of 32 held keys (64 KiB blocks), against the raw lookup. Tier and raw
runs alternate order each round (A/B interleaved); ratios are taken within each round and
summarized by their median (min-max over rounds).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import click
import numpy as np
import torch

from bench.common import time_store_retrieve
from cli.args import CONTEXT, Choices, invoke, positive
from cli.output import print_table, write_results
from cli.progress import tqdm
from cli.redis_servers import RedisServer, redis_binary
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.tier_config import tier_config

LAYOUT = KVLayout(32, 8, 128, torch.bfloat16)  # Llama-3-8B: 128 KiB of KV per token
SIZES = {"2M": 16, "32M": 256}  # block tokens
LOOKUP = (KVLayout(1, 8, 128, torch.bfloat16), 16, 32)  # 64 KiB blocks, 32 keys per lookup
RECORD_SLACK = 256  # a record's header, about


class Raw(Protocol):
    """The plain client of one medium: what a user would write without kvstrata."""

    def write(self, values: Sequence[bytes]) -> None: ...
    def read(self, count: int) -> int: ...  # bytes read back of the first `count` values
    def exists(self, count: int) -> None: ...
    def clear(self) -> None: ...


class RawFiles:
    """One file per value in a directory: write to a temporary name and rename; read whole."""

    def __init__(self, config: dict[str, Any], threads: int) -> None:
        self.dir = Path(config["path"]) / "raw-baseline"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pool = ThreadPoolExecutor(threads)

    def _path(self, i: int) -> Path:
        return self.dir / f"{i:08x}.bin"

    def write(self, values: Sequence[bytes]) -> None:
        def one(i: int) -> None:
            tmp = self.dir / f".{i:08x}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(values[i])
            os.rename(tmp, self._path(i))

        list(self.pool.map(one, range(len(values))))

    def read(self, count: int) -> int:
        return sum(self.pool.map(lambda i: len(self._path(i).read_bytes()), range(count)))

    def exists(self, count: int) -> None:
        assert all(os.path.isfile(self._path(i)) for i in range(count))

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)


class RawRedis:
    """redis-py pipelines of SET, GET and EXISTS on the tier's server."""

    def __init__(self, config: dict[str, Any], threads: int) -> None:
        from tiers.remote.tier import connect

        self.client = connect(config["url"], timeout_s=60.0)
        self.keys: list[bytes] = []

    def write(self, values: Sequence[bytes]) -> None:
        self.keys = [f"rawbench:{i}".encode() for i in range(len(values))]
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(self.keys, values):
            pipe.set(k, v)
        pipe.execute()

    def read(self, count: int) -> int:
        pipe = self.client.pipeline(transaction=False)
        for k in self.keys[:count]:
            pipe.get(k)
        return sum(len(v) for v in pipe.execute())

    def exists(self, count: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in self.keys[:count]:
            pipe.exists(k)
        assert all(pipe.execute())

    def clear(self) -> None:
        if self.keys:
            self.client.delete(*self.keys)


# A shared tier's type -> its raw baseline: another shared tier is one entry here.
BASELINES: dict[str, Callable[[dict[str, Any], int], Raw]] = {"sharedfs": RawFiles, "remote": RawRedis}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _store(config: dict[str, Any], layout: KVLayout, block: int, tag: str) -> KVCacheStore:
    return KVCacheStore(StoreConfig(layout, block_size=block, namespace=f"bench-shared-{tag}", tiers=[config],
                                    verify_tokens=True, persist_on_close=False))


def _tier_round(config: dict[str, Any], block: int, kv: torch.Tensor, out: torch.Tensor, rnd: int) -> dict[str, float]:
    tokens = np.arange(rnd * 10_000_000, rnd * 10_000_000 + kv.shape[2], dtype=np.uint32)
    with _store(config, LAYOUT, block, f"{block}-{rnd}") as store:
        t_store, t_get = time_store_retrieve(store, tokens, kv, out)
    nbytes = kv.numel() * kv.element_size()
    return {"tier_store_gbps": _gbps(nbytes, t_store), "tier_retrieve_gbps": _gbps(nbytes, t_get)}


def _raw_round(raw: Raw, values: list[bytes]) -> dict[str, float]:
    nbytes = sum(len(v) for v in values)
    t0 = time.perf_counter()
    raw.write(values)
    t_write = time.perf_counter() - t0
    t_read = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        got = raw.read(len(values))
        t_read = min(t_read, time.perf_counter() - t0)
    assert got == nbytes
    raw.clear()
    return {"raw_write_gbps": _gbps(nbytes, t_write), "raw_read_gbps": _gbps(nbytes, t_read)}


def _lookups(config: dict[str, Any], raw: Raw, n: int) -> dict[str, float]:
    """p50/p99 in microseconds of `n` lookups of 32 held keys through the tier and raw, interleaved."""
    layout, block, count = LOOKUP
    tokens = np.arange(count * block, dtype=np.uint32) + 7
    kv = torch.zeros(layout.block_shape(len(tokens)), dtype=layout.dtype)
    tier_us, raw_us = [], []
    with _store(config, layout, block, "lookup") as store:
        store.store(tokens, kv)
        assert store.flush()
        keys = store.keys(tokens)
        raw.write([b"\0" * layout.block_bytes(block)] * count)
        for i in range(n):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    assert store.blocks.lookup(keys).num_blocks == count
                else:
                    raw.exists(count)
                (tier_us if which == 0 else raw_us).append((time.perf_counter() - t0) * 1e6)
        raw.clear()
        store.clear()
    q = lambda xs, p: float(np.percentile(xs, p))  # noqa: E731
    return {"tier_p50_us": q(tier_us, 50), "tier_p99_us": q(tier_us, 99), "raw_p50_us": q(raw_us, 50),
            "raw_p99_us": q(raw_us, 99), "p50_vs_raw": q(tier_us, 50) / q(raw_us, 50)}


def bench_tier(config: dict[str, Any], sizes: list[str], mib: int, repeat: int, lookups: int) -> dict[str, Any]:
    threads = int(getattr(tier_config(config), "io_threads", 1))  # what the tier runs its I/O on
    raw = BASELINES[config["type"]](config, threads)
    out: dict[str, Any] = {"threads": threads}
    for label in sizes:
        block = SIZES[label]
        num = max(1, (mib << 20) // LAYOUT.block_bytes(block))
        kv = torch.randn(LAYOUT.block_shape(num * block), generator=torch.Generator().manual_seed(1)).to(LAYOUT.dtype)
        out_buf = torch.empty_like(kv)
        size = LAYOUT.block_bytes(block) + RECORD_SLACK
        flat = kv.view(torch.uint8).numpy().reshape(-1)
        values = [flat[(i * size) % (len(flat) - size):][:size].tobytes() for i in range(num)]
        rounds = []
        for rnd in range(repeat):
            got: dict[str, float] = {}
            for which in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                got.update(_tier_round(config, block, kv, out_buf, rnd) if which == 0 else _raw_round(raw, values))
            got["store_vs_raw"] = got["tier_store_gbps"] / got["raw_write_gbps"]
            got["retrieve_vs_raw"] = got["tier_retrieve_gbps"] / got["raw_read_gbps"]
            rounds.append(got)
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        spread = {k: (min(r[k] for r in rounds), max(r[k] for r in rounds)) for k in rounds[0] if "_vs_" in k}
        out[label] = {"block_bytes": LAYOUT.block_bytes(block), "num_blocks": num, "median": med,
                      "ratio_range": spread, "rounds": rounds}
    out["lookup"] = _lookups(config, raw, lookups)
    return out


@contextlib.contextmanager
def _resolved(configs: list[dict[str, Any]], workdir: Path) -> Iterator[list[dict[str, Any]]]:
    """The configs with what they leave out filled in: a `sharedfs` path in `workdir`, a
    `remote` URL of a `redis-server` started here (stopped after)."""
    servers: list[RedisServer] = []
    out = []
    try:
        for i, c in enumerate(configs):
            c = dict(c)
            if c.get("type") == "sharedfs" and "path" not in c:
                c["path"] = str(workdir / f"sharedfs-{i}")
            if c.get("type") == "remote" and "url" not in c:
                redis_binary("--tier")
                servers.append(RedisServer(None, "--maxmemory", "3gb").start())
                c["url"] = servers[-1].url
            tier_config(c, "--tier")  # one clear error for a bad config, before anything runs
            if c.get("type") not in BASELINES:
                raise click.UsageError(f"--tier of type {c.get('type')!r} has no raw baseline; "
                                       f"known: {sorted(BASELINES)}")
            out.append(c)
        yield out
    finally:
        for s in servers:
            s.stop()


def run(configs: list[dict[str, Any]], sizes: list[str], mib: int, repeat: int, workdir: Path | None,
        lookups: int = 200) -> dict[str, object]:
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="kvstrata-shared-", dir=workdir))
    results: dict[str, Any] = {}
    try:
        with _resolved(configs, root) as resolved:
            for i, c in enumerate(tqdm(resolved, desc="shared tiers", leave=False, disable=None)):
                name = str(c["type"])
                results[name if name not in results else f"{name}#{i}"] = bench_tier(c, sizes, mib, repeat, lookups)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = [round(x, 1) for x in (*load_before, *os.getloadavg())]
    rows = []
    for name, res in results.items():
        for label in sizes:
            med, rng = res[label]["median"], res[label]["ratio_range"]
            for op, raw_op in (("store", "write"), ("retrieve", "read")):
                low, high = rng[f"{op}_vs_raw"]
                rows.append([name, label, op, med[f"tier_{op}_gbps"], med[f"raw_{raw_op}_gbps"],
                             f"{med[f'{op}_vs_raw']:.2f} ({low:.2f}-{high:.2f})"])
        lk = res["lookup"]
        rows.append([name, "32 keys", "lookup p50/p99 us", f"{lk['tier_p50_us']:.0f}/{lk['tier_p99_us']:.0f}",
                     f"{lk['raw_p50_us']:.0f}/{lk['raw_p99_us']:.0f}", f"{lk['p50_vs_raw']:.2f} (p50)"])
    print_table(f"Shared tiers vs their raw clients, same bytes, same threads, same round; medians of {repeat} "
                f"rounds (load average before {load[:3]}, after {load[3:]})",
                ["tier", "block", "op", "tier GB/s", "raw GB/s", "tier/raw"], rows)
    shown = [{k: ("<given>" if k == "url" else v) for k, v in c.items()} for c in configs]
    return {"mib": mib, "repeat": repeat, "tiers": shown, "load_average_before_after": load, "results": results}


class TierJSON(click.ParamType):
    name = "JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or "type" not in parsed:
            self.fail(f"{value!r}: a tier config as a JSON object with its \"type\"", param, ctx)
        return parsed


DEFAULT_TIERS: list[dict[str, Any]] = [{"type": "sharedfs"}, {"type": "remote"}]


@click.command("shared-tiers", help=__doc__, context_settings=CONTEXT)
@click.option("--tier", "tiers", type=TierJSON(), multiple=True,
              help='a shared tier config as JSON, repeatable [default: {"type": "sharedfs"} and {"type": "remote"}]')
@click.option("--sizes", type=Choices(list(SIZES), str.upper), default=",".join(SIZES), show_default=True,
              help="block sizes to measure")
@click.option("--mib", type=positive(), default=256, show_default=True, help="MiB of KV per block size")
@click.option("--repeat", type=positive(), default=3, show_default=True, help="rounds (A/B interleaved)")
@click.option("--lookups", type=positive(), default=200, show_default=True, help="lookups of 32 keys, each side")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="where a sharedfs tier without a path writes (default: the system's temporary directory)")
def command(tiers: tuple[dict[str, Any], ...], sizes: list[str], mib: int, repeat: int, lookups: int,
            workdir: str | None) -> None:
    write_results("shared_tiers", run(list(tiers) or DEFAULT_TIERS, sizes, mib, repeat,
                                      Path(workdir) if workdir else None, lookups))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench shared-tiers")
