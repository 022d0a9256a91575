"""Who spends the CPU of a remote read or store: this process (user, system) or the server.

One real `redis-server` (started here, loopback); a remote-only store of the Llama-3-8B
layout, `--tokens` tokens per block (2: 256 KiB values), saves and then loads 2,048 tokens'
blocks through the engine API (`blocks.save` + `flush`, `blocks.load` into contiguous
blocks), `--rounds` times each. For each call: wall time, this process's user and system CPU
(`os.times`, 10 ms ticks: read the medians) and the server process's CPU (`/proc/PID/stat`),
each per block. Where this process's CPU per block is about its wall time, the client is the
bottleneck; where the server's is, the server is.
Table to stdout; JSON to `--out` (default results/remote_cpu_split_<time>.json).

    python scripts/remote_cpu_split.py --tokens 2 --connections 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cli.output import write_report
from cli.redis_servers import RedisServer
from kvstore import KVCacheStore, KVLayout, StoreConfig

LLAMA_3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
TOKENS = 2048
_TICK = os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def run(block_tokens: int, connections: int, rounds: int) -> dict[str, Any]:
    kv = torch.randn(LLAMA_3_8B.block_shape(TOKENS), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    server = RedisServer(None, "--maxmemory", "0").start()
    assert server.proc is not None
    rows: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
    try:
        tier = {"type": "remote", "url": server.url, "connections_per_node": connections}
        cfg = StoreConfig(LLAMA_3_8B, block_size=block_tokens, tiers=[tier], namespace="cpu-split",
                          result_buffer_bytes=0)
        with KVCacheStore(cfg) as store:
            keys = store.keys(np.arange(TOKENS, dtype=np.uint32))
            srcs = [kv[:, :, i * block_tokens : (i + 1) * block_tokens].contiguous() for i in range(len(keys))]
            dsts = [torch.zeros_like(s) for s in srcs]

            def save() -> None:
                store.blocks.save(keys, srcs)
                assert store.flush(), "the remote tier did not flush"

            def load() -> None:
                assert store.blocks.load(keys, dsts).num_blocks == len(keys)

            save()
            load()  # warm: connections, record buffers, destinations faulted in
            for _ in range(rounds):
                for what, call in (("save", save), ("load", load)):
                    if what == "save":
                        store.clear()
                    c0, s0, t0 = os.times(), _server_cpu(server.proc.pid), time.perf_counter()
                    call()
                    wall, c1, s1 = time.perf_counter() - t0, os.times(), _server_cpu(server.proc.pid)
                    n = len(keys) / 1e6
                    rows[what].append({"wall_us": wall / n, "user_us": (c1.user - c0.user) / n,
                                       "system_us": (c1.system - c0.system) / n, "server_us": (s1 - s0) / n})
            assert all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(dsts, srcs))
    finally:
        server.stop()
    medians = {what: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for what, runs in rows.items()}
    print(f"{LLAMA_3_8B.block_bytes(block_tokens) >> 10} KiB values, {connections} connections, "
          f"median of {rounds} (us per block):")
    for what, m in medians.items():
        print(f"  {what}: wall {m['wall_us']:6.0f}  client user {m['user_us']:5.0f}  system {m['system_us']:5.0f}"
              f"  server {m['server_us']:5.0f}")
    return {"block_tokens": block_tokens, "connections": connections, "rounds": rows, "medians": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2, help="tokens per block (2: 256 KiB values)")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = run(args.tokens, args.connections, args.rounds)
    write_report(report, "remote_cpu_split", args.out)


if __name__ == "__main__":
    main()
