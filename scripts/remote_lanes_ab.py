"""One connection against four (`connections_per_node`) for the remote tier's reads and stores, by value size.

One real `redis-server` (started here, loopback). For each value size (`--tokens` tokens per
block of the Llama-3-8B layout: 2 is 256 KiB) two remote-only stores on the same server, one
with one connection per node and one with four (a call of 4 MiB or more is then split into
lanes on four threads), time `retrieve(out=)` of `--mib` MiB (alternating 1, 4, 4, 1 over
`--rounds` rounds), then `store()` + `flush()` of it (1, 4 then 4, 1; the namespace cleared
before each, untimed).
Median GiB/s of each and 4 / 1.
Table to stdout; JSON to `--out` (default results/remote_lanes_ab_<time>.json).

    python scripts/remote_lanes_ab.py --tokens 2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from cli.output import write_report
from cli.redis_servers import RedisServer
from kvstore import KVCacheStore, KVLayout, StoreConfig

LLAMA_3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _one_size(url: str, block: int, t: np.ndarray, kv: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """GiB/s of every timed read and store, by "read c=1" and so on."""
    out = torch.zeros_like(kv)
    gib = kv.numel() * kv.element_size() / (1 << 30)
    runs: dict[str, list[float]] = {}
    stores = {c: KVCacheStore(StoreConfig(LLAMA_3_8B, block_size=block, namespace=f"lanes-ab-{block}",
                                          tiers=[{"type": "remote", "url": url, "connections_per_node": c}],
                                          result_buffer_bytes=0)) for c in (1, 4)}
    try:
        stores[1].store(t, kv)
        assert stores[1].flush(), "the remote tier did not flush"
        for store in stores.values():
            store.retrieve(t, out=out)  # warm: connections, lanes, record buffers
        for r in range(rounds):
            for c in (1, 4, 4, 1) if r % 2 == 0 else (4, 1, 1, 4):
                t0 = time.perf_counter()
                got = stores[c].retrieve(t, out=out).num_tokens
                runs.setdefault(f"read c={c}", []).append(gib / (time.perf_counter() - t0))
                assert got == len(t), f"read {got} of {len(t)} tokens"
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        for r in range(rounds):  # after the reads: a clear by one store makes the other's next read miss once
            for c in (1, 4) if r % 2 == 0 else (4, 1):
                stores[c].clear()
                t0 = time.perf_counter()
                stores[c].store(t, kv)
                assert stores[c].flush(), "the remote tier did not flush"
                runs.setdefault(f"store c={c}", []).append(gib / (time.perf_counter() - t0))
    finally:
        for store in stores.values():
            store.close()
    return runs


def run(mib: int, rounds: int, tokens: list[int]) -> dict[str, Any]:
    num = mib * 8  # 128 KiB of KV per token
    t = np.arange(num, dtype=np.uint32)
    kv = torch.randn(LLAMA_3_8B.block_shape(num), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    server = RedisServer(None, "--maxmemory", "0").start()
    results: dict[str, Any] = {}
    try:
        for block in tokens:
            runs = _one_size(server.url, block, t, kv, rounds)
            label = f"{block * 128}K"
            results[label] = {"runs": runs}
            for what in ("read", "store"):
                one, four = statistics.median(runs[f"{what} c=1"]), statistics.median(runs[f"{what} c=4"])
                results[label][what] = {"c1": one, "c4": four, "ratio": four / one}
                print(f"{label:>6} values {what:5}: 1 connection {one:5.2f}  4 connections {four:5.2f} GiB/s  "
                      f"4 / 1 {four / one:5.2f}", flush=True)
    finally:
        server.stop()
    return {"mib": mib, "rounds": rounds, "tokens": tokens, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", default="2,4,8,16", help="tokens per block, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = run(args.mib, args.rounds, [int(x) for x in args.tokens.split(",")])
    write_report(report, "remote_lanes_ab", args.out)


if __name__ == "__main__":
    main()
