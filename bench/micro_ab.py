"""`bench micro` of two checkouts, interleaved: the cost of a change, as ratios.

Runs `bench micro` alternately from checkout A (before) and B (after), each run a fresh
process with its own working directory (its `results/`), the order alternating every round
(ABBA...), so machine noise falls on both alike. Every numeric figure both runs report is
paired; the table gives each side's median over the rounds and B/A. Figures are times
(`ns`, `_s`), rates (`gbps`, `bps`) or ratios: read "B/A" against the unit in the name.

    python -m bench.micro_ab --before /tmp/kvstrata-before --after . --rounds 4

`scripts/micro_before_after.sh REV` makes the "before" checkout with `git worktree`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cli.output import print_table, write_results

_RUN = ("import importlib, sys; m = importlib.import_module('bench.micro'); "
        "sys.exit(m.main(sys.argv[1:]))")


def run_once(checkout: Path, args: list[str]) -> dict[str, object]:
    """One `bench micro` from `checkout` in a fresh directory; its JSON results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}  # each side its defaults
    env["PYTHONPATH"] = str(checkout)
    with tempfile.TemporaryDirectory(prefix="kvstrata-micro-ab-") as cwd:
        done = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"bench micro from {checkout} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        loaded: dict[str, object] = json.loads((Path(cwd) / "results" / "micro.json").read_text())
        return loaded


def flatten(value: object, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of `value` by its dotted path (the machine description left out)."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in ("machine", "benchmark"):
                out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)
    return out


def compare(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[list[object]]:
    """Rows of (figure, median A, median B, B/A) for the figures every run reported."""
    common = set.intersection(*(set(r) for r in before + after))
    rows: list[list[object]] = []
    for name in sorted(common):
        a = statistics.median(r[name] for r in before)
        b = statistics.median(r[name] for r in after)
        rows.append([name, a, b, b / a if a else float("nan")])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--after", type=Path, default=Path("."), help="checkout B (default: here)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each side, interleaved")
    parser.add_argument("--mib", default="16", help="bench micro --mib")
    parser.add_argument("--sizes", default="16K,256K,4M", help="bench micro --sizes")
    ns = parser.parse_args(argv)
    for side in (ns.before, ns.after):
        if not (side / "bench" / "micro.py").is_file():
            parser.error(f"{side} is not a kvstrata checkout with bench/micro.py")
    if ns.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {ns.rounds}")
    args = ["--mib", ns.mib, "--sizes", ns.sizes, "--repeat", "3"]
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(ns.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            print(f"round {i + 1}/{ns.rounds}: {side}", flush=True)
            runs[side].append(flatten(run_once(getattr(ns, side).resolve(), args)))
    rows = compare(runs["before"], runs["after"])
    print_table(f"bench micro, median of {ns.rounds} interleaved runs each: A = {ns.before}, B = {ns.after}",
                ["figure", "A", "B", "B/A"], rows)
    write_results("micro_ab", {"before": str(ns.before), "after": str(ns.after), "rounds": ns.rounds,
                               "args": args, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
