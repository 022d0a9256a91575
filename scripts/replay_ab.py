"""The cost of replaying another process's disk-index changes into this process's copy (what
a lookup beside a writer pays first), in two source trees, interleaved.

Each arm runs in a process of its own with one tree first on `sys.path`: it builds the copy
(`CompactHashSet`) of `--blocks` random hashes, then replays `--records` change-log records
(each `--batch` evicted hashes and as many new ones, 8-byte namespace tag first, as the disk
tier logs them) through `parse_log` and `Mirror._apply`, timing each record. A merge that
comes due runs between records, untimed (the tier runs it on a thread). Arms alternate
A B B A per pair of rounds. Reported per tree: median and p90 µs per record over all
rounds, and B / A.
Table to stdout; JSON to `--out` (default results/replay_ab_<time>.json).

    git worktree add --detach /tmp/before REV
    nice -n 5 python scripts/replay_ab.py /tmp/before .
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from cli.output import write_report

_ARM = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import msgpack, numpy as np
from types import SimpleNamespace
from tiers.disk.hashset import CompactHashSet
from tiers.disk.index import parse_log
from tiers.disk.mirror import Mirror
blocks, records, batch = map(int, sys.argv[2:5])
tag = b"T" * 8
raw = np.random.default_rng(1).bytes(16 * blocks)
held = [raw[i : i + 16] for i in range(0, len(raw), 16)]
hashes = CompactHashSet.from_keys(held)
hashes.defer_merges = True
mirror = SimpleNamespace(_tag=tag, hashes=hashes, _start_merge=lambda: None)
fresh = np.random.default_rng(2).bytes(16 * batch * records)
logs = [msgpack.packb([[tag + h for h in held[r * batch : (r + 1) * batch]],
                       [tag + fresh[i : i + 16] for i in range(r * batch * 16, (r + 1) * batch * 16, 16)]])
        for r in range(records)]
times = []
for raw_record in logs:
    t0 = time.perf_counter()
    Mirror._apply(mirror, *parse_log(raw_record))
    times.append(time.perf_counter() - t0)
    if hashes.merge_due:
        hashes.merge()
assert len(hashes) == blocks
print(json.dumps(times))
"""


def arm(tree: str, args: argparse.Namespace) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, "-c", _ARM, os.path.abspath(tree), str(args.blocks), str(args.records),
                          str(args.batch)], env=env, capture_output=True, text=True, check=True)
    times: list[float] = json.loads(out.stdout)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="tree A (the baseline)")
    ap.add_argument("b", help="tree B")
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--records", type=int, default=60)
    ap.add_argument("--batch", type=int, default=2048, help="hashes evicted and added per record")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per tree (even: A B B A)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            times[name] += arm(args.a if name == "A" else args.b, args)
    rows: dict[str, Any] = {}
    for name, ts in times.items():
        us = np.array(ts) * 1e6
        rows[name] = {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
                      "records": len(ts)}
    ratio = {k: rows["B"][k] / rows["A"][k] for k in ("median_us", "p90_us")}
    print(f"replay of one record ({args.batch} evicted + {args.batch} added) into a copy of {args.blocks:,} hashes")
    print(f"{'tree':<6}{'median µs':>12}{'p90 µs':>12}{'records':>10}")
    for name in ("A", "B"):
        row = rows[name]
        print(f"{name:<6}{row['median_us']:>12.0f}{row['p90_us']:>12.0f}{row['records']:>10}")
    print(f"{'B / A':<6}{ratio['median_us']:>12.2f}{ratio['p90_us']:>12.2f}")
    write_report({"args": vars(args), "trees": {"A": args.a, "B": args.b}, "rows": rows, "b_over_a": ratio},
                 "replay_ab", args.out)


if __name__ == "__main__":
    main()
