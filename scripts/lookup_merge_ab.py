"""Disk-tier lookups while another process writes: the in-memory index merged in place or on a thread.

A disk tier directory is filled with `--blocks` blocks (tiny payloads: the index is what is
measured; the tier at capacity). A writer process then stores `--batches` transactions of
`--batch` new blocks per round (each evicting as many), while this process times
`match_prefix` of a held `--prompt`-block prompt every `--gap-ms` ms: each lookup first replays
the writer's changes into this process's copy of the index. Rounds alternate how that copy
merges its changes into its sorted columns (in place / thread, then thread / in place):
"in place" is the set merging inside the lookup that crosses the threshold (as before
`tiers/disk/mirror.py` ran merges on a thread), "thread" the tier's default. Reported per
mode: lookups, p50/p99/p99.9/max in µs, merges; and thread / in place.
Table to stdout; JSON to `--out` (default results/lookup_merge_ab_<time>.json).

    python scripts/lookup_merge_ab.py --blocks 1000000
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from cli.output import write_report
from tiers.disk.tier import LMDBTier, bytes_per_block
from tiers.keys import BlockHash, BlockKey

SHAPE = (2, 4)  # 16-byte payloads
_WRITER = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from scripts.lookup_merge_ab import fill, open_tier
tier, seed = open_tier(sys.argv[2], int(sys.argv[3])), 1
for line in sys.stdin:
    batches, batch = map(int, line.split())
    for _ in range(batches):
        seed += 1
        fill(tier, batch, batch, seed)
    print("done", flush=True)
tier.close()
"""


def open_tier(path: str, blocks: int) -> LMDBTier:
    return LMDBTier(path, blocks * bytes_per_block(2 * SHAPE[0] * SHAPE[1]), SHAPE, torch.float16, sync="none",
                    verify_tokens=False)


def fill(tier: LMDBTier, n: int, batch: int, seed: int) -> list[BlockHash]:
    """Store `n` blocks of random hashes, `batch` a transaction; their hashes."""
    raw = np.random.default_rng(seed).bytes(16 * n)
    hashes = [BlockHash(raw[i : i + 16]) for i in range(0, len(raw), 16)]
    src = torch.zeros(SHAPE, dtype=torch.float16)
    for a in range(0, n, batch):
        part = hashes[a : a + batch]
        tier.put([BlockKey(h) for h in part], [src] * len(part))
    return hashes


def _round(tier: LMDBTier, writer: subprocess.Popen[str], prompt: list[BlockHash], args: argparse.Namespace,
           in_place: bool) -> dict[str, Any]:
    mirror = tier._mirror  # type: ignore[attr-defined]
    with mirror._lock:
        hashes = mirror.hashes
        hashes.merge()  # each round starts from merged columns
        hashes.defer_merges = not in_place  # (deferred: the mirror merges on a thread)
        merges = hashes.num_merges
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write(f"{args.batches} {args.batch}\n")
    writer.stdin.flush()
    times, hits = [], []
    while not select.select([writer.stdout], [], [], 0)[0]:
        t0 = time.perf_counter()
        hits.append(tier.match_prefix(prompt))
        times.append(time.perf_counter() - t0)
        time.sleep(args.gap_ms / 1000)
    assert writer.stdout.readline().strip() == "done"
    us = np.array(times) * 1e6
    return {"mode": "in place" if in_place else "thread", "lookups": len(us), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "p999_us": float(np.percentile(us, 99.9)),
            "max_us": float(us.max()), "merges": mirror.hashes.num_merges - merges,
            "short_lookups": sum(h != len(prompt) for h in hits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=40, help="write transactions per round")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2, help="each runs in place and thread (alternating order)")
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="directory to hold the tier (default: a temporary one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="lookup-merge-", dir=args.dir)
    tier = open_tier(root, args.blocks)
    t0 = time.perf_counter()
    fill(tier, args.blocks - args.prompt, args.batch, 0)
    prompt = fill(tier, args.prompt, args.batch, 10**9)  # the newest: evicted last
    print(f"filled {args.blocks} blocks in {time.perf_counter() - t0:.0f} s", flush=True)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, here, root, str(args.blocks)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            for in_place in (True, False) if r % 2 == 0 else (False, True):
                rows.append(_round(tier, writer, prompt, args, in_place) | {"round": r})
                print(rows[-1], flush=True)
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        writer.wait(timeout=600)
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, dict[str, float]] = {}
    for mode in ("in place", "thread"):
        mine = [row for row in rows if row["mode"] == mode]
        summary[mode] = {k: float(np.median([row[k] for row in mine])) for k in ("p50_us", "p99_us", "p999_us",
                                                                                 "max_us", "merges")}
    print(f"\n{args.blocks} blocks; writer: {args.batches} x {args.batch} blocks a round; lookups of "
          f"{args.prompt} blocks every {args.gap_ms} ms (medians over {args.rounds} rounds)")
    print(f"{'':10} {'p50 us':>10} {'p99 us':>10} {'p99.9 us':>10} {'max us':>10} {'merges':>7}")
    for mode, s in summary.items():
        print(f"{mode:10} {s['p50_us']:10.0f} {s['p99_us']:10.0f} {s['p999_us']:10.0f} {s['max_us']:10.0f} "
              f"{s['merges']:7.0f}")
    ratios = {k: summary["thread"][k] / summary["in place"][k] for k in ("p50_us", "p99_us", "p999_us", "max_us")}
    print("thread / in place: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_report({"command": " ".join(sys.argv), "blocks": args.blocks, "rows": rows, "summary": summary,
                  "thread_vs_in_place": ratios}, "lookup_merge_ab", args.out)


if __name__ == "__main__":
    main()
