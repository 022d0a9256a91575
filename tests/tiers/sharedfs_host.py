"""One host of the shared-filesystem tests, run as its own process:
`python -m tests.tiers.sharedfs_host COMMAND ROOT ...`; prints one JSON line.

- `share ROOT INDEX HOSTS`: a store with its own pool and CPU tier over the shared directory
  stores its prompts, waits for every host's, and reads back every other host's.
- `fill ROOT CAPACITY PROMPTS SEED`: stores `PROMPTS` prompts into a directory of `CAPACITY`
  bytes (scans every 0.05 s), so several such hosts evict at once.
- `write-forever ROOT`: stores large blocks until killed.
- `fsize ROOT LIMIT`: stores under `RLIMIT_FSIZE` = LIMIT bytes (SIGXFSZ ignored: a write past
  it fails with EFBIG), then reads back.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore import KVCacheStore, KVLayout, StoreConfig
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tiers.sharedfs.tier import SharedFSTier

PROMPT_BLOCKS = 4
BIG = KVLayout(num_layers=128, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 8 MiB per 16 tokens


def tokens(seed: int, blocks: int = PROMPT_BLOCKS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=blocks * BLOCK, dtype=np.uint32)


def open_store(root: str, *, layout: KVLayout = LAYOUT, local: bool = True, **shared: Any) -> KVCacheStore:
    """A store of a host: a pool and a CPU tier of its own (`local`), the shared directory."""
    block = layout.block_bytes(BLOCK)
    tiers: list[Any] = [{"type": "pool", "num_blocks": 8, "device": "cpu"},
                        {"type": "cpu", "capacity_bytes": 8 * block}] if local else []
    tiers.append({"type": "sharedfs", "path": root, "capacity_bytes": 64 << 20, **shared})
    return KVCacheStore(StoreConfig(layout, block_size=BLOCK, namespace="sharedfs-hosts", tiers=tiers,
                                    persist_on_close=False))


def shared_tier(store: KVCacheStore) -> SharedFSTier:
    tier = store.tiers[-1]
    assert isinstance(tier, SharedFSTier)
    return tier


def share(root: str, index: int, hosts: int) -> dict[str, Any]:
    marks = Path(root).parent
    with open_store(root) as store:
        for j in range(3):
            t = tokens(100 * index + j)
            store.store(t, make_kv(t, LAYOUT, BLOCK))
        (marks / f"stored-{index}").touch()
        deadline = time.monotonic() + 60
        while len(list(marks.glob("stored-*"))) < hosts:
            assert time.monotonic() < deadline, "the other hosts did not store in 60 s"
            time.sleep(0.05)
        read = from_shared = 0
        for other in range(hosts):
            for j in range(3):
                if other == index:
                    continue
                t = tokens(100 * other + j)
                res = store.retrieve(t)
                read += check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
                from_shared += sum(n for kind, n in res.blocks_per_tier.items() if kind == "sharedfs")
        return {"blocks_read": read, "from_shared": from_shared, "corrupt": shared_tier(store).counters.num_corrupt}


def fill(root: str, capacity: int, prompts: int, seed: int) -> dict[str, Any]:
    with open_store(root, local=False, capacity_bytes=capacity, scan_interval_s=0.05) as store:
        for j in range(prompts):
            t = tokens(seed * 100_000 + j)
            store.store(t, make_kv(t, LAYOUT, BLOCK))
        tier = shared_tier(store)
        return {"evicted": tier.space.num_evicted, "drops": tier.num_write_drops, "errors": tier.num_errors}


def write_forever(root: str) -> None:
    with open_store(root, layout=BIG, local=False, capacity_bytes=1 << 40) as store:
        print(json.dumps({"started": True}), flush=True)
        for j in range(1_000_000):
            t = tokens(j, blocks=2)
            store.store(t, torch.zeros(BIG.block_shape(len(t)), dtype=BIG.dtype))


def fsize(root: str, limit: int) -> dict[str, Any]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    t = tokens(7)
    with open_store(root, local=False) as store:
        store.store(t, make_kv(t, LAYOUT, BLOCK))  # must not raise
        tier = shared_tier(store)
        got = store.retrieve(t).num_tokens
        return {"drops": tier.num_write_drops, "errors": tier.num_errors, "retrieved_tokens": got,
                "files": sorted(p.name for p in Path(root).rglob("*") if p.is_file())}


def main(argv: list[str]) -> None:
    command, root, *rest = argv
    if command == "write-forever":
        write_forever(root)
        return
    out = {"share": lambda: share(root, int(rest[0]), int(rest[1])),
           "fill": lambda: fill(root, int(rest[0]), int(rest[1]), int(rest[2])),
           "fsize": lambda: fsize(root, int(rest[0]))}[command]()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
