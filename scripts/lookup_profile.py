"""Where a 2,048-block `lookup`'s CPU time goes in a disk-only store of N blocks, filled as
`kvstrata bench scale-disk` fills it (same config, same prompts), measured in that process:
the whole `lookup` and its parts timed alone, ns per block, the best of 20 calls, three
rounds interleaved: the token list made an array, the chained hashing (that and the array),
the tier stack's plan (its per-block loop around the disk tier's `match_prefix`), the disk
tier's `match_prefix` (the mirror's refresh and the hash set's probe), the hash set's
`count_prefix` alone, the list of tier kinds. For the last prompt stored ("recent": among the
set's pending adds, as the bench's lookup finds it) and the first ("stored": long merged into
its sorted columns). JSON to stdout.

    nice -n 5 python scripts/lookup_profile.py --blocks 10000 --blocks 1000000 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.scale import BLOCK
from bench.scale_disk import _batches, _layout, _store, config
from kvstore import KVCacheStore
from kvstore.hashing import as_token_array


def _best(fn: Callable[[], object], repeat: int = 20) -> float:
    least = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        least = min(least, time.process_time() - t)
    return least


def profile(n: int, root: str | None) -> dict[str, object]:
    """Fill a disk tier of `n` blocks, then time a lookup of its first and last prompts and their parts."""
    tmp = tempfile.mkdtemp(prefix="kvstrata-lookup-profile-", dir=root)
    try:
        rng = np.random.default_rng(n)
        batch, layout = _batches(n, 0.0), _layout(0.0)
        kv = torch.zeros(layout.block_shape(batch * BLOCK), dtype=layout.dtype)
        with KVCacheStore(config(tmp, n, 0.0)) as store:
            first = _store(store, batch, batch, kv, rng)[2]
            last = _store(store, n - batch, batch, kv, rng)[2] if n > batch else first
            stack, disk = store._stack, store.tiers[-1]
            hashset = disk._mirror.hashes  # type: ignore[attr-defined]
            out: dict[str, object] = {"blocks": n, "pending_adds": len(hashset._added)}
            for name, tokens in (("recent", last), ("stored", first)):
                hashes = store._keyer.hashes(tokens, None)[1]
                plan = stack.plan_lookup(hashes)
                assert len(plan) == len(hashes), f"the {name} prompt is not held"
                parts: dict[str, Callable[[], object]] = {
                    "lookup": lambda t=tokens: store.lookup(t),  # type: ignore[misc]
                    "token_array": lambda t=tokens: as_token_array(t),  # type: ignore[misc]
                    "hashing": lambda t=tokens: store._keyer.hashes(t, None),  # type: ignore[misc]
                    "plan": lambda h=hashes: stack.plan_lookup(h),  # type: ignore[misc]
                    "disk_match_prefix": lambda h=hashes: disk.match_prefix(h, 0),  # type: ignore[misc]
                    "set_probe": lambda h=hashes: hashset.count_prefix(h),  # type: ignore[misc]
                    "kinds": lambda p=plan: [stack.tiers[i].kind for i in p],  # type: ignore[misc]
                }
                rounds: dict[str, list[float]] = {k: [] for k in parts}
                for _ in range(3):
                    for k, fn in parts.items():
                        rounds[k].append(_best(fn) / len(hashes) * 1e9)
                ns = {k: min(v) for k, v in rounds.items()}
                out[name] = {"blocks": len(hashes), "in_pending_adds": sum(h in hashset._added for h in hashes),
                             "ns_per_block": ns, "rounds_ns_per_block": rounds,
                             "share_of_lookup": {k: v / ns["lookup"] for k, v in ns.items() if k != "lookup"}}
            return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--blocks", type=int, action="append", help="N (repeatable; default 10^4 and 10^6)")
    ap.add_argument("--dir", default=None, help="where the disk tiers are made (removed after)")
    args = ap.parse_args()
    print(json.dumps([profile(n, args.dir) for n in args.blocks or [10_000, 1_000_000]], indent=1))


if __name__ == "__main__":
    main()
