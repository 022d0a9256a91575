"""A fleet of simulated hosts replaying a trace, with and without a shared remote tier.

`kvstrata bench trace --fleet N [--remote-url URL]`: requests go round-robin to N hosts (a
router that knows nothing of KV); each host is a real store with its own pool and CPU tier.
Without a remote tier a host hits only what it computed itself; with one (a `redis-server`
on loopback unless `--remote-url`), every block any host stored is visible to all, once
flushed (each host flushes after its request, as write-behind would within a request's
lifetime). Reports the block hit ratio of each, and the infinite-cache ceiling.
"""

from __future__ import annotations

import torch

from bench.trace import _LAYOUT, TRACE_BLOCK_TOKENS, infinite_hits, serve_request
from cli.output import print_table
from cli.progress import tqdm
from cli.redis_servers import server_url
from kvstore import KVCacheStore, StoreConfig
from tiers.keys import TierKind


def replay_fleet(requests: list[list[int]], hosts: int, pool_blocks: int, cpu_blocks: int,
                 remote_url: str | None, desc: str) -> dict[str, float]:
    block_bytes = _LAYOUT.block_bytes(TRACE_BLOCK_TOKENS)
    configs = [StoreConfig(_LAYOUT, block_size=TRACE_BLOCK_TOKENS, namespace="trace-fleet", pool_blocks=pool_blocks,
                           pool_device="cpu", cpu_bytes=cpu_blocks * block_bytes, verify_tokens=False,
                           persist_on_close=False, remote_url=remote_url) for _ in range(hosts)]
    stores = [KVCacheStore(c) for c in configs]
    hits = {k: 0 for k in TierKind}
    refs = 0
    longest = max(len(ids) for ids in requests) * TRACE_BLOCK_TOKENS
    payload = torch.zeros(_LAYOUT.block_shape(longest), dtype=_LAYOUT.dtype)
    try:
        if remote_url is not None:
            stores[0].clear()  # a fresh remote namespace for this replay
        for i, ids in enumerate(tqdm(requests, desc=desc, leave=False, disable=None)):
            store = stores[i % hosts]
            refs += serve_request(store, ids, payload, hits)
            if remote_url is not None:
                store.flush()
    finally:
        for store in stores:
            store.close()
    return {"hit_ratio": sum(hits.values()) / refs, **{f"hits_{k.value}": float(v) for k, v in hits.items()}}


def run_fleet(requests: list[list[int]], hosts: int, pool_blocks: int, cpu_blocks: int,
              remote_url: str | None) -> dict[str, object]:
    inf_hits, refs = infinite_hits(requests)
    with server_url(remote_url, "--remote-url") as url:  # checked (or started) before the first replay
        local = replay_fleet(requests, hosts, pool_blocks, cpu_blocks, None, f"{hosts} hosts, local tiers only")
        shared = replay_fleet(requests, hosts, pool_blocks, cpu_blocks, url, f"{hosts} hosts + remote tier")
    print_table(f"Fleet of {hosts} hosts (round-robin), pool {pool_blocks} + CPU {cpu_blocks} blocks each: "
                "block hit ratio",
                ["local tiers only", "with a shared remote tier", "infinite cache", "remote / local",
                 "hits served by the remote tier"],
                [[local["hit_ratio"], shared["hit_ratio"], inf_hits / refs,
                  shared["hit_ratio"] / local["hit_ratio"] if local["hit_ratio"] else float("inf"),
                  int(shared["hits_remote"])]])
    return {"hosts": hosts, "pool_blocks": pool_blocks, "cpu_blocks": cpu_blocks, "local": local, "shared": shared,
            "infinite_hit_ratio": inf_hits / refs}
