"""`kvstrata demo-remote`: two "hosts" share one long document's KV through Valkey/Redis.

Host A and host B are two processes with their own CPU and disk tiers (different
`disk_path`s) and one shared remote tier. Host A stores the document's KV; host B, which
never saw it, retrieves it from the remote tier, bit-exact, and a second retrieve on host B
is served locally (the remote hit was promoted). Without `--url`, a `redis-server` is started
on a loopback port for the demo (it must be installed: `apt-get install redis-server`, or
run one in a container and pass `--url redis://HOST:6379`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import click
import numpy as np
import torch

from cli.args import CONTEXT, Directory, check_memory, invoke
from cli.demo_dir import prepare
from cli.output import print_table
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.keys import TierKind
from tiers.remote.tier import redacted

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
BLOCK = 16


def _config(url: str, disk_path: str, tokens: int) -> StoreConfig:
    return StoreConfig(LAYOUT, block_size=BLOCK, namespace="kvstrata-demo-remote",
                       cpu_bytes=tokens * LAYOUT.token_bytes * 2, disk_path=disk_path,
                       disk_bytes=4 * tokens * LAYOUT.token_bytes + (64 << 20), disk_sync=False,
                       remote_url=url, remote_timeout_s=5.0)


def _document(tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = np.random.default_rng(7).integers(0, 128_000, size=tokens).tolist()
    kv = torch.randn(LAYOUT.block_shape(tokens), generator=torch.Generator().manual_seed(7)).to(LAYOUT.dtype)
    return ids, kv


def _remote_counters(store: KVCacheStore) -> dict[str, int]:
    """What the remote tier counted: server faults, writes dropped, records that failed checks."""
    tier = next(t for t in store.tiers if t.kind is TierKind.REMOTE)
    return {"errors": int(getattr(tier, "num_errors", 0)), "dropped": int(getattr(tier, "num_write_drops", 0)),
            "corrupt": tier.stats().num_corrupt}


def host(role: str, url: str, disk_path: str, tokens: int) -> dict[str, object]:
    """One host's part, run in its own process: A stores, B retrieves twice."""
    ids, kv = _document(tokens)
    rows: dict[str, object] = {}
    with KVCacheStore(_config(url, disk_path, tokens)) as store:
        if role == "a":
            t0 = time.perf_counter()
            store.store(ids, kv)
            rows["flushed"] = store.flush()
            rows["store_s"] = time.perf_counter() - t0
        else:
            for step in ("first", "second"):
                t0 = time.perf_counter()
                res = store.retrieve(ids)
                rows[f"{step}_s"] = time.perf_counter() - t0
                rows[f"{step}_tiers"] = {k.value: v * BLOCK for k, v in res.blocks_per_tier.items()}
                rows[f"{step}_tokens"] = res.num_tokens
                rows[f"{step}_exact"] = res.num_tokens == 0 or (res.kv is not None and torch.equal(
                    res.kv.view(torch.int16), kv[:, :, : res.num_tokens].view(torch.int16)))
        rows["remote"] = _remote_counters(store)
    return rows


def _counted(counters: dict[str, int], where: str) -> list[str]:
    words = {"errors": "server errors", "dropped": "writes dropped", "corrupt": "records failed their checks"}
    return [f"{words[k]} on {where}: {n}" for k, n in counters.items() if n]


def store_result(a: dict[str, Any]) -> str:
    """Host A's row: whether every block reached the server, and if not, what was counted."""
    if a["flushed"] and not any(a["remote"].values()):
        return "yes"
    why = ([] if a["flushed"] else ["flush() timed out"]) + _counted(a["remote"], "host A")
    return "NO: " + "; ".join(why)


def retrieve_result(a: dict[str, Any], b: dict[str, Any], step: str, tokens: int) -> str:
    """Host B's row: `yes` for the whole document bit-exact, else `NO: <why>`."""
    expected = tokens // BLOCK * BLOCK
    found, exact = b[f"{step}_tokens"], b[f"{step}_exact"]
    if found == expected and exact:
        return "yes"
    if not exact:
        return f"NO: the {found} tokens found differ from what host A stored"
    why = _counted(a["remote"], "host A") + _counted(b["remote"], "host B")
    if not a["flushed"]:
        why.insert(0, "host A's flush() timed out")
    if not why:
        why = ["nothing was counted: the server no longer holds them (evicted: see its maxmemory)"]
    return f"NO: {found} of {expected} tokens found; " + "; ".join(why)


def _tiers(by_tier: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in by_tier.items()) or "none"


def _run_hosts(url: str, folder: str, tokens: int) -> dict[str, dict[str, Any]] | str:
    """Run host A then host B, each its own process; their results, or why one failed."""
    out = {}
    for role in ("a", "b"):
        done = subprocess.run([sys.executable, "-m", "cli.main", "demo-remote", "--role", role, "--url", url,
                               "--tokens", str(tokens), "--disk-path", folder],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"host {role.upper()} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        out[role] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@click.command("demo-remote", help=__doc__, context_settings=CONTEXT)
@click.option("--url", default=None, help="a Valkey/Redis URL (default: start redis-server on loopback)")
@click.option("--tokens", type=click.IntRange(BLOCK, 1 << 20), default=8192, show_default=True)
@click.option("--disk-path", type=Directory(), default="kvstrata_data", show_default=True,
              help="hosts A and B keep their disk tiers in DISK_PATH/demo-remote/host-a and host-b; the demo makes "
                   "and marks DISK_PATH/demo-remote, and its next run replaces only that folder")
@click.option("--role", type=click.Choice(["a", "b"]), default=None, hidden=True)
def command(**options: Any) -> int:
    args = SimpleNamespace(**options)
    if args.role:  # a host process; --disk-path is the demo's own folder
        print(json.dumps(host(args.role, args.url, f"{args.disk_path}/host-{args.role}", args.tokens)))
        return 0
    from cli.redis_servers import RedisServer, check_server, redis_binary

    # Each host process: the document's KV made in float32, its bfloat16 copy, the CPU tier's and B's retrieve.
    check_memory(5 * args.tokens * LAYOUT.token_bytes, f"--tokens {args.tokens}")
    if args.url is not None:
        check_server(args.url, "--url")
    else:
        redis_binary("--url")
    folder = str(prepare(args.disk_path, "demo-remote", fresh=True))
    room = f"{max(512, 2 * args.tokens * LAYOUT.token_bytes >> 20)}mb"  # the document and the records' headers
    server = RedisServer(None, "--maxmemory", room).start() if args.url is None else None
    url = server.url if server is not None else args.url
    try:
        out = _run_hosts(url, folder, args.tokens)
    finally:
        if server is not None:
            server.stop()
    if isinstance(out, str):
        print(out, file=sys.stderr)
        return 1
    mib = args.tokens * LAYOUT.token_bytes / 2**20
    a, b = out["a"], out["b"]
    rows = [
        ["host A", "store + flush", "-", f"{a['store_s'] * 1e3:.0f}", store_result(a)],
        ["host B", "retrieve (never saw it)", _tiers(b["first_tiers"]), f"{b['first_s'] * 1e3:.0f}",
         retrieve_result(a, b, "first", args.tokens)],
        ["host B", "retrieve again", _tiers(b["second_tiers"]), f"{b['second_s'] * 1e3:.0f}",
         retrieve_result(a, b, "second", args.tokens)],
    ]
    where = "a loopback redis-server" if server else redacted(url)
    print(f"document: {args.tokens} tokens, {mib:.0f} MiB of KV; remote tier at {where}; disk tiers in {folder}")
    print_table("kvstrata demo-remote: two hosts, one shared remote tier",
                ["host", "step", "tokens by tier", "ms", "all of it, bit-exact"], rows)
    ok = all(r[-1] == "yes" for r in rows) and TierKind.REMOTE.value in b["first_tiers"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata demo-remote")


if __name__ == "__main__":
    sys.exit(main())
