"""The Mooncake tier against Mooncake's own client on the same master (`kvstrata bench mooncake`).

Store and retrieve GB/s at 2 MiB and 32 MiB blocks through the tier (records encoded into
its registered buffer, checksummed, validated and copied out) against the raw client's
`batch_put_from` / `batch_get_into` of the same bytes from a registered buffer, interleaved
in one run, both clients moving their bytes to a third that holds the pool's memory (a
storage host, here in the same process: loopback TCP); and the latency of a 32-key lookup
(p50, p99). Starts its own `mooncake_master` on loopback (TCP transport). Rows:
`{"tier", "block_bytes", "op", "gbps", "baseline_gbps", "ratio", "ratio_range"}` (rates: medians
of the rounds; ratio: the median of each round's tier/raw, their range beside).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results
from cli.ports import free_port
from tiers.keys import BlockHash, BlockKey
from tiers.mooncake.client import close_idle
from tiers.tier_config import TierContext, tier_config


def _start_master() -> tuple[subprocess.Popen[bytes], str, str]:
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    port, http, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                             "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                             "--http_metadata_server_host=127.0.0.1", f"--metrics_port={metrics}",
                             "--enable_metric_reporting=false"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "GLOG_minloglevel": "2"})
    for _ in range(400):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/metadata"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


BLOCK_SIZES = (2 << 20, 32 << 20)


def measure(block_sizes: tuple[int, ...] | None = None, total_bytes: int = 128 << 20,
            repeat: int = 3) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Rows per (block size, op) and the 32-key lookup's latency {"p50_us", "p99_us"}."""
    from mooncake.store import MooncakeDistributedStore

    block_sizes = block_sizes or BLOCK_SIZES
    proc, master, metadata = _start_master()
    rows: list[dict[str, Any]] = []
    try:
        # One client holds the pool's memory (a storage host); the raw client and the tier give
        # none, so both move their bytes to it through the transfer engine alike.
        pool = MooncakeDistributedStore()
        assert pool.setup("127.0.0.1", metadata, 3 * total_bytes + (256 << 20), 16 << 20, "tcp", "", master) == 0
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master) == 0
        buf = np.random.default_rng(0).integers(0, 255, size=total_bytes, dtype=np.uint8)
        out = np.empty_like(buf)
        raw.register_buffer(buf.ctypes.data, buf.nbytes)
        raw.register_buffer(out.ctypes.data, out.nbytes)
        for block in block_sizes:
            n = total_bytes // block
            ctx = TierContext((1, 1, 1, 1, block), torch.uint8, BlockHash(os.urandom(16)))
            tier = tier_config({"type": "mooncake", "master": master, "metadata_server": metadata,
                                "local_hostname": "127.0.0.1", "segment_bytes": 0,
                                "buffer_bytes": 2 * (total_bytes + (1 << 20)), "timeout_s": 30}).open(ctx)
            srcs = [torch.from_numpy(buf[i * block : (i + 1) * block]).view(1, 1, 1, 1, block) for i in range(n)]
            dsts = [torch.empty((1, 1, 1, 1, block), dtype=torch.uint8) for _ in range(n)]
            times: dict[str, list[float]] = {k: [] for k in ("raw put", "tier put", "raw get", "tier get")}
            for r in range(-1, repeat):  # round -1 warms the buffers up, untimed
                names = [f"raw:{block}:{r}:{i}" for i in range(n)]
                ptrs = [buf.ctypes.data + i * block for i in range(n)]
                keys = [BlockKey(BlockHash(os.urandom(16)), b"") for _ in range(n)]
                t = time.perf_counter()
                assert all(c == 0 for c in raw.batch_put_from(names, ptrs, [block] * n))
                times["raw put"].append(time.perf_counter() - t)
                t = time.perf_counter()
                assert tier.put(keys[::-1], srcs[::-1]) == n
                times["tier put"].append(time.perf_counter() - t)
                t = time.perf_counter()
                assert all(c == block for c in raw.batch_get_into(names, [out.ctypes.data + i * block
                                                                          for i in range(n)], [block] * n))
                times["raw get"].append(time.perf_counter() - t)
                t = time.perf_counter()
                assert tier.get_into(keys, dsts) == n
                times["tier get"].append(time.perf_counter() - t)
                assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
                raw.batch_remove(names, True)
                tier.clear()
                if r < 0:
                    times = {k: [] for k in times}
            for op in ("put", "get"):
                tier_s, raw_s = times[f"tier {op}"], times[f"raw {op}"]
                ratios = [r / t for t, r in zip(tier_s, raw_s)]  # per round: the pair ran back to back
                rows.append({"tier": "mooncake", "block_bytes": block, "op": "store" if op == "put" else "retrieve",
                             "gbps": _gbps(n * block, float(np.median(tier_s))),
                             "baseline_gbps": _gbps(n * block, float(np.median(raw_s))),
                             "ratio": float(np.median(ratios)), "ratio_range": [min(ratios), max(ratios)]})
            if block == block_sizes[0]:  # 32 blocks held, each lookup asks for all of them
                ids = [BlockKey(BlockHash(os.urandom(16)), b"") for _ in range(32)]
                assert tier.put(ids[::-1], [srcs[i % n] for i in range(32)][::-1]) == 32
                hashes = [k.block_hash for k in ids]
                lat = []
                for _ in range(300):
                    t = time.perf_counter()
                    assert tier.match_prefix(hashes) == 32
                    lat.append(time.perf_counter() - t)
                lookup = {"p50_us": float(np.percentile(lat, 50) * 1e6), "p99_us": float(np.percentile(lat, 99) * 1e6)}
            tier.close()
        close_idle()  # the tiers' clients, while the master runs
        raw.close()
        pool.close()
    finally:
        proc.kill()
    return rows, lookup


@click.command("mooncake", help=__doc__, context_settings=CONTEXT)
@click.option("--mib", type=positive(), default=128, show_default=True, help="MiB moved per op and block size")
@click.option("--repeat", type=positive(), default=3, show_default=True, help="rounds (tier and raw interleaved)")
def command(mib: int, repeat: int) -> None:
    rows, lookup = measure(total_bytes=mib << 20, repeat=repeat)
    print_table(f"Mooncake tier vs Mooncake's raw batch_put_from/batch_get_into, same master, interleaved; "
                f"medians of {repeat} rounds",
                ["tier", "block", "op", "tier GB/s", "raw GB/s", "tier/raw"],
                [[r["tier"], f"{r['block_bytes'] >> 20} MiB", r["op"], r["gbps"], r["baseline_gbps"],
                  f"{r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})"]
                 for r in rows])
    print(f"lookup of 32 keys: p50 {lookup['p50_us']:.0f} us, p99 {lookup['p99_us']:.0f} us")
    write_results("mooncake", {"mib": mib, "repeat": repeat, "rows": rows, "lookup_32": lookup})


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench mooncake")
