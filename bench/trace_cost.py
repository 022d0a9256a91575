"""`kvstrata bench trace --policy ... --cost`: what each eviction policy costs the CPU tier.

A real store with only a CPU tier (1/16 of the trace's unique blocks) replays the first
`--limit` requests (default 2000) of a trace: each request a `retrieve` then a `store`, as
`kvstrata bench trace` does. Blocks are tiny (2 KiB: a 512-token block of a one-head, one-dim
layout), so the tier's bookkeeping, not the copy, is what is timed: the worst case for a
policy's overhead. Rounds run every policy once each, in rotating order (A/B interleaved);
reported: the median over rounds of microseconds per block of the requests stored and
retrieved (hits and misses alike), and each policy's ratio to LRU's in the same rounds.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.trace import _LAYOUT, TRACE_BLOCK_TOKENS, tokens_for
from bench.trace_policy import NAMES, Trace
from cli.output import print_table
from kvstore import KVCacheStore, StoreConfig


def replay_timed(trace: Trace, capacity: int, policy: str, payload: torch.Tensor) -> tuple[float, float, int, int]:
    """(seconds in store, seconds in retrieve, blocks stored, blocks retrieved) of one replay."""
    cfg = StoreConfig(_LAYOUT, block_size=TRACE_BLOCK_TOKENS, namespace="cost",
                      cpu_bytes=capacity * _LAYOUT.block_bytes(TRACE_BLOCK_TOKENS), verify_tokens=False,
                      persist_on_close=False, cpu_eviction=policy, result_buffer_bytes=0)
    tokens = [tokens_for(ids) for ids in trace.requests]
    t_store = t_get = 0.0
    n_store = n_get = 0
    with KVCacheStore(cfg) as store:
        for toks in tokens:
            t0 = time.perf_counter()
            store.retrieve(toks)
            t1 = time.perf_counter()
            store.store(toks, payload[:, :, : len(toks)])
            t2 = time.perf_counter()
            t_get += t1 - t0
            t_store += t2 - t1
            n_get += len(toks) // TRACE_BLOCK_TOKENS
            n_store += len(toks) // TRACE_BLOCK_TOKENS
    return t_store, t_get, n_store, n_get


def run_cost(trace: Trace, policies: list[str], rounds: int) -> dict[str, object]:
    if "lru" not in policies:
        policies = ["lru", *policies]
    capacity = max(1, trace.unique // 16)
    longest = max(len(ids) for ids in trace.requests) * TRACE_BLOCK_TOKENS
    payload = torch.zeros(_LAYOUT.block_shape(longest), dtype=_LAYOUT.dtype)
    per: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
    for r in range(rounds):
        for policy in policies[r % len(policies):] + policies[: r % len(policies)]:
            t_store, t_get, n_store, n_get = replay_timed(trace, capacity, policy, payload)
            per[policy].append((1e6 * t_store / n_store, 1e6 * t_get / n_get))
    rows = {}
    for p in policies:
        store_us = statistics.median(x for x, _ in per[p])
        get_us = statistics.median(y for _, y in per[p])
        store_ratio = statistics.median(a[0] / b[0] for a, b in zip(per[p], per["lru"]))
        get_ratio = statistics.median(a[1] / b[1] for a, b in zip(per[p], per["lru"]))
        rows[p] = {"store_us_per_block": store_us, "retrieve_us_per_block": get_us,
                   "store_vs_lru": store_ratio, "retrieve_vs_lru": get_ratio}
    print_table(f"{trace.name}: CPU tier cost per block by policy ({len(trace.requests)} requests, capacity "
                f"{capacity} blocks, {rounds} interleaved rounds; median; ratio to LRU of the same round)",
                ["policy", "store us/block", "retrieve us/block", "store vs LRU", "retrieve vs LRU"],
                [[NAMES[p], r["store_us_per_block"], r["retrieve_us_per_block"], f"{r['store_vs_lru']:.3f}x",
                  f"{r['retrieve_vs_lru']:.3f}x"] for p, r in rows.items()])
    return {"trace": trace.name, "requests": len(trace.requests), "capacity_blocks": capacity, "rounds": rounds,
            "rows": rows}
