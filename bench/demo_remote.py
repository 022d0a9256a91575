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
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import click
import numpy as np
import torch

from bench.args import CONTEXT, Directory, invoke
from bench.common import print_table
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.base import TierKind
from tiers.remote import redacted

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _config(url: str, disk_path: str, tokens: int) -> StoreConfig:
    return StoreConfig(LAYOUT, block_size=16, namespace="kvstrata-demo-remote",
                       cpu_bytes=tokens * LAYOUT.token_bytes * 2, disk_path=disk_path,
                       disk_bytes=4 * tokens * LAYOUT.token_bytes + (64 << 20), disk_sync=False,
                       remote_url=url, remote_timeout_s=5.0)


def _document(tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = np.random.default_rng(7).integers(0, 128_000, size=tokens).tolist()
    kv = torch.randn(LAYOUT.block_shape(tokens), generator=torch.Generator().manual_seed(7)).to(LAYOUT.dtype)
    return ids, kv


def host(role: str, url: str, disk_path: str, tokens: int) -> dict[str, object]:
    """One host's part, run in its own process: A stores, B retrieves twice."""
    ids, kv = _document(tokens)
    rows: dict[str, object] = {}
    with KVCacheStore(_config(url, disk_path, tokens)) as store:
        if role == "a":
            t0 = time.perf_counter()
            store.store(ids, kv)
            assert store.flush()
            rows["store_s"] = time.perf_counter() - t0
        else:
            for step in ("first", "second"):
                t0 = time.perf_counter()
                res = store.retrieve(ids)
                rows[f"{step}_s"] = time.perf_counter() - t0
                rows[f"{step}_tiers"] = {k.value: v * 16 for k, v in res.blocks_per_tier.items()}
                exact = res.kv is not None and torch.equal(res.kv.view(torch.int16),
                                                           kv[:, :, : res.num_tokens].view(torch.int16))
                rows[f"{step}_exact"] = exact and res.num_tokens == len(ids) // 16 * 16
    return rows


@click.command("demo-remote", help=__doc__, context_settings=CONTEXT)
@click.option("--url", default=None, help="a Valkey/Redis URL (default: start redis-server on loopback)")
@click.option("--tokens", type=click.IntRange(16, 1 << 20), default=8192, show_default=True)
@click.option("--disk-path", type=Directory(), default="kvstrata_data/demo-remote", show_default=True,
              help="hosts A and B use <disk-path>/host-a and /host-b")
@click.option("--role", type=click.Choice(["a", "b"]), default=None, hidden=True)
def command(**options: Any) -> int:
    args = SimpleNamespace(**options)
    if args.role:  # a host process
        print(json.dumps(host(args.role, args.url, f"{args.disk_path}/host-{args.role}", args.tokens)))
        return 0
    from bench.redis_servers import RedisServer

    shutil.rmtree(args.disk_path, ignore_errors=True)
    server = None
    url = args.url
    if url is None:
        server = RedisServer().start()
        url = server.url
    try:
        out = {}
        for role in ("a", "b"):
            done = subprocess.run([sys.executable, "-m", "bench.cli", "demo-remote", "--role", role, "--url", url,
                                   "--tokens", str(args.tokens), "--disk-path", args.disk_path],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            out[role] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        if server is not None:
            server.stop()
    mib = args.tokens * LAYOUT.token_bytes / 2**20
    a, b = out["a"], out["b"]
    rows = [
        ["host A", "store + flush", "-", f"{a['store_s'] * 1e3:.0f}", "-"],
        ["host B", "retrieve (never saw it)", b["first_tiers"], f"{b['first_s'] * 1e3:.0f}",
         "yes" if b["first_exact"] else "NO"],
        ["host B", "retrieve again", b["second_tiers"], f"{b['second_s'] * 1e3:.0f}",
         "yes" if b["second_exact"] else "NO"],
    ]
    where = "a loopback redis-server" if server else redacted(url)
    print(f"document: {args.tokens} tokens, {mib:.0f} MiB of KV; remote tier at {where}")
    print_table("kvstrata demo-remote: two hosts, one shared remote tier",
                ["host", "step", "tokens by tier", "ms", "bit-exact"], rows)
    ok = b["first_exact"] and b["second_exact"] and TierKind.REMOTE.value in b["first_tiers"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata demo-remote")


if __name__ == "__main__":
    sys.exit(main())
