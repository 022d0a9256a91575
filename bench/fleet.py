"""A fleet of simulated hosts replaying a trace, with and without a shared tier.

`kvstrata bench trace --fleet N [--remote-url URL | --shared-tier JSON]`: requests go
round-robin to N hosts (a router that knows nothing of KV); each host is a real store with
its own pool and CPU tier. Without a shared tier a host hits only what it computed itself;
with one (a remote tier on a loopback `redis-server` unless `--remote-url`, or any shared
tier's config, e.g. `{"type": "sharedfs", "path": "/mnt/kv"}`), every block any host stored
is visible to all, once flushed (each host flushes after its request, as write-behind would
within a request's lifetime). Reports the block hit ratio of each, and the infinite-cache
ceiling.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from bench.trace import _LAYOUT, TRACE_BLOCK_TOKENS, infinite_hits, serve_request
from cli.output import print_table
from cli.progress import tqdm
from cli.redis_servers import server_url
from kvstore import KVCacheStore, StoreConfig
from tiers.keys import TierKind


def _config(pool_blocks: int, cpu_blocks: int, shared: dict[str, Any] | None) -> StoreConfig:
    """A host's store: its own pool and CPU tier, then the shared tier (None: none)."""
    block_bytes = _LAYOUT.block_bytes(TRACE_BLOCK_TOKENS)
    tiers: list[Any] = [{"type": "pool", "num_blocks": pool_blocks, "device": "cpu"}]
    if cpu_blocks:
        tiers.append({"type": "cpu", "capacity_bytes": cpu_blocks * block_bytes})
    if shared is not None:
        tiers.append(shared)
    return StoreConfig(_LAYOUT, block_size=TRACE_BLOCK_TOKENS, namespace="trace-fleet", tiers=tiers,
                       verify_tokens=False, persist_on_close=False)


def replay_fleet(requests: list[list[int]], hosts: int, pool_blocks: int, cpu_blocks: int,
                 shared: dict[str, Any] | None, desc: str) -> dict[str, float]:
    stores = [KVCacheStore(_config(pool_blocks, cpu_blocks, shared)) for _ in range(hosts)]
    hits: Counter[TierKind] = Counter({k: 0 for k in TierKind})
    shared_kinds = {t.kind for t in stores[0].tiers if t.traits.shared}
    refs = 0
    longest = max(len(ids) for ids in requests) * TRACE_BLOCK_TOKENS
    payload = torch.zeros(_LAYOUT.block_shape(longest), dtype=_LAYOUT.dtype)
    try:
        if shared is not None:
            stores[0].clear()  # a fresh shared namespace for this replay
        for i, ids in enumerate(tqdm(requests, desc=desc, leave=False, disable=None)):
            store = stores[i % hosts]
            refs += serve_request(store, ids, payload, hits)
            if shared is not None:
                store.flush()
    finally:
        for store in stores:
            store.close()
    return {"hit_ratio": sum(hits.values()) / refs, "hits_shared": float(sum(hits[k] for k in shared_kinds)),
            **{f"hits_{k.value}": float(v) for k, v in hits.items()}}


@contextlib.contextmanager
def _shared_tier(remote_url: str | None, shared: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """The shared tier's config: `shared` as given (a sharedfs tier without a path: a fresh
    temporary directory, removed after), else a remote tier on `remote_url` (or a loopback
    redis-server, checked or started before the first replay)."""
    if shared is not None:
        if shared.get("type") == "sharedfs" and "path" not in shared:
            with tempfile.TemporaryDirectory(prefix="kvstrata-fleet-") as tmp:
                yield {**shared, "path": tmp}
            return
        yield shared
        return
    with server_url(remote_url, "--remote-url") as url:
        yield {"type": "remote", "url": url}


def run_fleet(requests: list[list[int]], hosts: int, pool_blocks: int, cpu_blocks: int,
              remote_url: str | None, shared: dict[str, Any] | None = None) -> dict[str, object]:
    inf_hits, refs = infinite_hits(requests)
    with _shared_tier(remote_url, shared) as config:
        kind = str(config["type"])
        local = replay_fleet(requests, hosts, pool_blocks, cpu_blocks, None, f"{hosts} hosts, local tiers only")
        with_shared = replay_fleet(requests, hosts, pool_blocks, cpu_blocks, config, f"{hosts} hosts + {kind} tier")
    print_table(f"Fleet of {hosts} hosts (round-robin), pool {pool_blocks} + CPU {cpu_blocks} blocks each: "
                "block hit ratio",
                ["local tiers only", f"with a shared {kind} tier", "infinite cache", "shared / local",
                 f"hits served by the {kind} tier"],
                [[local["hit_ratio"], with_shared["hit_ratio"], inf_hits / refs,
                  with_shared["hit_ratio"] / local["hit_ratio"] if local["hit_ratio"] else float("inf"),
                  int(with_shared["hits_shared"])]])
    return {"hosts": hosts, "pool_blocks": pool_blocks, "cpu_blocks": cpu_blocks, "shared_tier": kind,
            "local": local, "shared": with_shared, "infinite_hit_ratio": inf_hits / refs}
