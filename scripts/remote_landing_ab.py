"""The remote tier's reads with and without landing in place (`RecordCodec.landing`), in one process.

One real `redis-server` (started here, loopback). For each value size (256 KiB, 2 MiB and 32
MiB: chunks of 2, 16 and 256 tokens of the Llama-3-8B layout, as `kvstrata bench peer`'s
remote rows) a remote-only store holds `--mib` MiB of KV; `retrieve(out=)` into the rows of
a faulted-in `[layers, 2, tokens, heads, dim]` buffer is timed with landing off (every value
received into a record buffer, then checked and copied out: the code before) and on (the
payload received straight into `out`'s rows), alternating off, on, on, off for `--rounds`
rounds. Off is done by raising the smallest run landed (`MIN_RUN_BYTES`) past any block, so
both sides run the same code otherwise. 256 KiB and 2 MiB blocks have runs of 4 and 32 KiB,
below the 128 KiB that lands: both sides copy (a check on the noise); 32 MiB blocks have
runs of 512 KiB. `--min-run` lands shorter runs on the "on" side (what 32 KiB would give).
Median GB/s of each side and on / off.
Table to stdout; JSON to `--out` (default results/remote_landing_ab_<time>.json).

    nice -n 5 python scripts/remote_landing_ab.py --connections 1,4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

import tiers.shared.record as record
from cli.output import write_report
from cli.redis_servers import RedisServer
from kvstore import KVCacheStore, KVLayout, StoreConfig

LLAMA_3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
SIZES = {"256K": 2, "2M": 16, "32M": 256}  # value size -> tokens per block
LANDS = record.MIN_RUN_BYTES


def run(mib: int, rounds: int, connections: list[int], lands: int = LANDS,
        sizes: dict[str, int] | None = None) -> dict[str, Any]:
    tokens = mib * 1024 // 128  # 128 KiB of KV per token
    t = np.arange(tokens, dtype=np.uint32)
    kv = torch.randn(LLAMA_3_8B.block_shape(tokens), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = torch.zeros_like(kv)
    nbytes = kv.numel() * kv.element_size()
    server = RedisServer(None, "--maxmemory", "0").start()
    results: dict[str, Any] = {}
    try:
        for conns in connections:
            for label, block in (sizes or SIZES).items():
                tier = {"type": "remote", "url": server.url, "connections_per_node": conns}
                cfg = StoreConfig(LLAMA_3_8B, block_size=block, tiers=[tier], namespace="landing-ab",
                                  result_buffer_bytes=0)
                runs: dict[str, list[float]] = {"off": [], "on": []}
                with KVCacheStore(cfg) as store:
                    store.store(t, kv)
                    assert store.flush(), "the remote tier did not flush"
                    store.retrieve(t, out=out)  # warm: connections, record buffers, out faulted in
                    for side in ["off", "on", "on", "off"] * rounds:
                        record.MIN_RUN_BYTES = lands if side == "on" else 1 << 62
                        t0 = time.perf_counter()
                        got = store.retrieve(t, out=out).num_tokens
                        runs[side].append(nbytes / (time.perf_counter() - t0) / 1e9)
                        assert got == tokens, f"read {got} of {tokens} tokens"
                    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
                    store.clear()
                record.MIN_RUN_BYTES = LANDS
                off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
                results[f"{label} c={conns}"] = {"off_gbps": runs["off"], "on_gbps": runs["on"], "off": off, "on": on,
                                                 "ratio": on / off}
                print(f"{label:>5} values, {conns} connections: off {off:5.2f}  on {on:5.2f} GB/s  "
                      f"on/off {on / off:5.3f}", flush=True)
    finally:
        server.stop()
    return {"mib": mib, "rounds": rounds, "connections": connections, "min_run_bytes": lands, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", default="1,4")
    parser.add_argument("--min-run", type=int, default=LANDS, help="smallest run landed on the 'on' side (bytes)")
    parser.add_argument("--tokens", default=None,
                        help="tokens per block, comma-separated (default 2,16,256: 256 KiB, 2 MiB, 32 MiB values)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = {f"{int(t) * 128}K": int(t) for t in args.tokens.split(",")} if args.tokens else None
    report = run(args.mib, args.rounds, [int(c) for c in args.connections.split(",")], args.min_run, sizes)
    write_report(report, "remote_landing_ab", args.out)


if __name__ == "__main__":
    main()
