"""Two versions of the disk tier's compact hash set (`tiers/disk/hashset.py`), interleaved in
one process: the build from N sorted index keys and the fastest of 20 `count_prefix` calls
on a 2,048-hash prompt, per round, alternating which goes first; JSON to stdout.

    git show REV:tiers/disk/hashset.py > /tmp/old_hashset.py
    nice -n 5 python scripts/hashset_ab.py /tmp/old_hashset.py tiers/disk/hashset.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from types import ModuleType

import numpy as np


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sets = {"old": _load(args.old, "hashset_old").CompactHashSet, "new": _load(args.new, "hashset_new").CompactHashSet}
    raw = np.random.default_rng(1).bytes(16 * args.blocks)
    tag = b"T" * 9
    keys = sorted(tag + raw[i : i + 16] for i in range(0, len(raw), 16))
    prompt = [k[len(tag):] for k in random.Random(2).sample(keys, 2048)]
    build: dict[str, list[float]] = {"old": [], "new": []}
    probe: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            t = time.process_time()
            s = sets[name].from_keys(iter(keys), skip=len(tag), size_hint=args.blocks)
            build[name].append(time.process_time() - t)
            best = float("inf")
            for _ in range(20):
                t = time.process_time()
                assert s.count_prefix(prompt) == len(prompt)
                best = min(best, time.process_time() - t)
            probe[name].append(best)
    print(json.dumps({"blocks": args.blocks, "build_cpu_s": build, "count_prefix_2048_cpu_s": probe,
                      "build_new_vs_old": min(build["new"]) / min(build["old"]),
                      "count_prefix_new_vs_old": min(probe["new"]) / min(probe["old"])}, indent=1))


if __name__ == "__main__":
    main()
