"""`kvstrata bench peer`: kvstrata's disk and remote tiers and LMCache's side by side.

Both sides store the same KV bytes (a Llama-3-8B layout, 128 KiB per token, bf16, in
256-token chunks: `--prompts` prompts of `--prompt-tokens` tokens), then look up prompt
prefixes of `--lookup-tokens` (hashing included, as each engine's lookup does), read every
chunk back, and finally a fresh process opens the same directory and looks the first prompt
up again (does the cache survive a restart?). Each side runs in its own process, the two
alternating for `--rounds` rounds in a fresh directory each; the table gives medians and
kvstrata / LMCache ratios, with a raw write and read of the same bytes (one file) from the
same rounds.

The LMCache side (`bench/peer_lmcache.py`) runs under `--lmcache-python`, an interpreter
with `pip install lmcache` (default: this one when it can import lmcache); it drives
LMCache's `LocalDiskBackend` and `ChunkedTokenDatabase` directly, the layers its engine uses,
so no GPU or vLLM is needed. Without LMCache the kvstrata side still runs and says so.
kvstrata runs with `disk_sync=none` (LMCache's disk writes do not sync either) and reads
into a preallocated buffer (`retrieve(out=)`), as LMCache reads into its allocator's.

The remote rows (`bench/peer_remote.py`, `--remote-mib`, 0 for none) store and read the same
KV in 256 KiB, 2 MiB and 32 MiB values through the remote tier and through LMCache's
`resp://` connector, against one `redis-server` the bench starts.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from cli.args import CONTEXT, Directory, IntList, invoke, positive
from cli.output import print_table, write_results

_WORKER = Path(__file__).with_name("peer_lmcache.py")


def kvstrata_side(spec: dict[str, Any]) -> dict[str, Any]:
    """The kvstrata side of one round (run in a child process: `python -m bench.peer`)."""
    import torch

    from bench.peer_lmcache import CHUNK, DIM, HEADS, LAYERS, _kv, _tokens
    from kvstore import KVCacheStore, KVLayout, StoreConfig

    layout = KVLayout(LAYERS, HEADS, DIM, torch.bfloat16)
    cfg = StoreConfig(layout, block_size=CHUNK, cpu_bytes=0, disk_path=spec["dir"], disk_sync="none",
                      disk_bytes=3 * (spec["mib"] << 20) + (256 << 20), result_buffer_bytes=0)
    prompts = [(_tokens(s, spec["prompt_tokens"]), _kv(s, spec["prompt_tokens"])) for s in spec["seeds"]]
    with KVCacheStore(cfg) as store:
        if spec["phase"] == "restart":
            return {"restart_hit_tokens": store.lookup(prompts[0][0])}
        out: dict[str, Any] = {"bytes": sum(kv.numel() * kv.element_size() for _, kv in prompts)}
        t0 = time.perf_counter()
        for tokens, kv in prompts:
            store.store(tokens, kv)
        out["write_s"] = time.perf_counter() - t0
        for n in spec["lookup_tokens"]:
            tokens = prompts[0][0][:n]
            assert store.lookup(tokens) == n
            times = []
            for _ in range(spec["lookups"]):
                t0 = time.perf_counter()
                store.lookup(tokens)
                times.append(time.perf_counter() - t0)
            out[f"lookup_{n}_us"] = statistics.median(times) * 1e6
        dsts = [torch.zeros_like(kv) for _, kv in prompts]  # faulted in, as LMCache's allocator is
        t0 = time.perf_counter()
        for (tokens, _), dst in zip(prompts, dsts):
            assert store.retrieve(tokens, out=dst).num_tokens == len(tokens)
        out["read_s"] = time.perf_counter() - t0
        assert all(torch.equal(d.view(torch.int16), kv.view(torch.int16)) for d, (_, kv) in zip(dsts, prompts))
    return out


def raw_side(spec: dict[str, Any]) -> dict[str, Any]:
    """A raw buffered write of the same bytes into one new file, and a warm read of it."""
    import torch

    from bench.peer_lmcache import _kv

    data = [_kv(s, spec["prompt_tokens"]).reshape(-1).view(torch.uint8).numpy() for s in spec["seeds"]]
    path = os.path.join(spec["dir"], "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for d in data:
            f.write(d)
    out = {"write_s": time.perf_counter() - t0, "bytes": sum(len(d) for d in data)}
    buf = bytearray(len(data[0]))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    out["read_s"] = time.perf_counter() - t0
    return out


def _child(side: str, spec: dict[str, Any], python: str) -> dict[str, Any]:
    if side == "lmcache":
        cmd = [python, str(_WORKER), json.dumps(spec)]
    else:
        cmd = [sys.executable, "-m", "bench.peer", json.dumps({**spec, "side": side})]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise click.ClickException(f"the {side} side failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def lmcache_python(given: str | None) -> str | None:
    """The interpreter to run LMCache with, or None if there is none."""
    for python in ([given] if given else [sys.executable]):
        ok = subprocess.run([python, "-c", "import lmcache.v1.storage_backend.local_disk_backend"],
                            capture_output=True, timeout=300).returncode == 0
        if ok:
            return python
        if given:
            raise click.BadParameter(f"{given!r} cannot import lmcache", param_hint="--lmcache-python")
    return None


def run(prompts: int = 4, prompt_tokens: int = 4096, lookup_tokens: list[int] | None = None, rounds: int = 3,
        workdir: str | None = None, python: str | None = None, remote_mib: int = 0,
        remote_connections: tuple[int, ...] = (4,)) -> dict[str, Any]:
    from bench import peer_remote

    lmc = lmcache_python(python)
    sides = ["raw", "kvstrata"] + (["lmcache"] if lmc else [])
    if lmc is None:
        print("LMCache is not installed here (pip install lmcache, or --lmcache-python): kvstrata side only")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    base = Path(tempfile.mkdtemp(prefix="kvstrata-peer-", dir=workdir))
    mib = prompts * prompt_tokens * 128 // 1024
    try:
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                where = base / f"{side}-{r}"
                where.mkdir()
                spec = {"phase": "run", "dir": str(where), "mib": mib, "seeds": list(range(1, prompts + 1)),
                        "prompt_tokens": prompt_tokens, "lookup_tokens": lookup_tokens or [1024, 4096],
                        "lookups": 200}
                res = _child(side, spec, lmc or sys.executable)
                if side != "raw":
                    res.update(_child(side, {**spec, "phase": "restart"}, lmc or sys.executable))
                results[side].append(res)
                shutil.rmtree(where)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = _report(results, lookup_tokens or [1024, 4096], rounds, mib)
    remote = peer_remote.run(remote_mib, rounds, lmc, remote_connections) if remote_mib else None
    if remote is not None:
        remote["table"] = peer_remote.rows(remote)
        print_table(f"kvstrata remote tier vs LMCache resp://, {remote['mib']} MiB of the same KV per value size, "
                    f"one redis-server (median of {rounds} interleaved rounds)",
                    ["measure", "kvstrata", "LMCache", "minimal client", "kvstrata / LMCache", "kvstrata / minimal"],
                    remote["table"])
        report["remote"] = remote
    return report


def _report(results: dict[str, list[dict[str, Any]]], lookup_tokens: list[int], rounds: int,
            mib: int) -> dict[str, Any]:
    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in results[side]) if side in results else float("nan")

    nbytes = med("kvstrata", "bytes")
    rows = [["store (GB/s)"] + [nbytes / med(s, "write_s") / 1e9 for s in ("kvstrata", "lmcache", "raw")],
            ["read back, warm (GB/s)"] + [nbytes / med(s, "read_s") / 1e9 for s in ("kvstrata", "lmcache", "raw")]]
    rows += [[f"lookup {n} tokens (us)", med("kvstrata", f"lookup_{n}_us"), med("lmcache", f"lookup_{n}_us"),
              float("nan")] for n in lookup_tokens]
    rows.append(["hit after a restart (tokens)", med("kvstrata", "restart_hit_tokens"),
                 med("lmcache", "restart_hit_tokens"), float("nan")])
    for row in rows:
        k, lm = row[1], row[2]
        better = k / lm if "GB/s" in row[0] else lm / k
        row.append(better if lm == lm and lm and k else "-")
    print_table(f"kvstrata disk tier vs LMCache local disk, {mib} MiB of Llama-3-8B KV in 256-token chunks "
                f"(median of {rounds} interleaved rounds)",
                ["measure", "kvstrata", "LMCache", "raw file I/O", "kvstrata advantage"], rows)
    return {"rounds": rounds, "results": results, "table": rows}


@click.command("peer", help=__doc__, context_settings=CONTEXT)
@click.option("--prompts", type=positive(), default=4, show_default=True)
@click.option("--prompt-tokens", type=positive(), default=4096, show_default=True,
              help="tokens per prompt (a multiple of 256)")
@click.option("--lookup-tokens", type=IntList(256), default="1024,4096", show_default=True)
@click.option("--rounds", type=positive(), default=3, show_default=True)
@click.option("--workdir", type=Directory(), default=None, help="directory on the disk to measure")
@click.option("--lmcache-python", default=None, help="a Python interpreter that can import lmcache")
@click.option("--remote-mib", type=click.IntRange(0), default=256, show_default=True,
              help="MiB of KV per value size for the remote rows (0: no remote rows)")
@click.option("--remote-connections", type=IntList(1, 64), default="4", show_default=True,
              help="connections_per_node of the remote tier: one kvstrata side each, in the same rounds")
def command(prompts: int, prompt_tokens: int, lookup_tokens: list[int], rounds: int, workdir: str | None,
            lmcache_python: str | None, remote_mib: int, remote_connections: list[int]) -> None:
    if prompt_tokens % 256 or any(n > prompt_tokens or n % 256 for n in lookup_tokens):
        raise click.BadParameter(f"token counts must be multiples of 256 and lookups at most --prompt-tokens, got "
                                 f"{prompt_tokens} and {lookup_tokens}")
    write_results("peer", run(prompts, prompt_tokens, lookup_tokens, rounds, workdir, lmcache_python, remote_mib,
                              tuple(remote_connections)))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench peer")


if __name__ == "__main__":
    from bench.peer_raw_resp import raw_side as minimal_side
    from bench.peer_remote import kvstrata_side as remote_side

    request = json.loads(sys.argv[1])
    fn = {"kvstrata": kvstrata_side, "kvstrata-remote": remote_side, "minimal-remote": minimal_side,
          "raw": raw_side}[request.pop("side")]
    print(json.dumps(fn(request)), flush=True)
