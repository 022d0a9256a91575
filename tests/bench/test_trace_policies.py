"""The policy replay: it agrees with a real store, its Belady bound is the exact optimum, and
`kvstrata bench trace --policy` is deterministic."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
import torch

from bench import trace
from bench.trace_policy import Trace, one_tier
from bench.trace_sim import SimTier, Stack, belady_hit_blocks
from cli import output
from kvstore import KVCacheStore, StoreConfig
from tiers.keys import TierKind
from tiers.policies.eviction import EvictionKind

TRACE = trace.DEFAULT_TRACE


@pytest.mark.parametrize("kind", list(EvictionKind))
def test_replay_counts_the_hits_of_a_real_store(kind: EvictionKind) -> None:
    """Request by request, the simulated tier hits exactly what a store with that CPU tier hits."""
    reqs = trace.load_trace(TRACE, limit=400)
    unique = len({b for ids in reqs for b in ids})
    capacity = unique // 16
    block_bytes = trace._LAYOUT.block_bytes(trace.TRACE_BLOCK_TOKENS)
    cfg = StoreConfig(trace._LAYOUT, block_size=trace.TRACE_BLOCK_TOKENS, namespace="t",
                      cpu_bytes=capacity * block_bytes, verify_tokens=False, persist_on_close=False, cpu_eviction=kind)
    payload = torch.zeros(trace._LAYOUT.block_shape(max(map(len, reqs)) * trace.TRACE_BLOCK_TOKENS),
                          dtype=trace._LAYOUT.dtype)
    hits = {k: 0 for k in TierKind}
    real = []
    with KVCacheStore(cfg) as store:
        for ids in reqs:
            before = hits[TierKind.CPU]
            trace.serve_request(store, ids, payload, hits)
            real.append(hits[TierKind.CPU] - before)
        store.check_integrity()
    sim = Stack([SimTier(capacity, kind)], [])
    assert [sim.serve(ids) for ids in reqs] == real
    assert sum(real) > 100  # the comparison covers hits, not only misses


def brute_force_best(requests: list[list[int]], capacity: int) -> int:
    """The most prefix hits over every choice of victim (or bypass) at every miss."""

    @functools.cache
    def best(r: int, j: int, cache: frozenset[int]) -> int:
        if r == len(requests):
            return 0
        ids = requests[r]
        gained = 0
        if j == 0:
            for b in ids:
                if b not in cache:
                    break
                gained += 1
        if j == len(ids):
            return best(r + 1, 0, cache)
        b = ids[j]
        if b in cache:
            return gained + best(r, j + 1, cache)
        options = [best(r, j + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(r, j + 1, cache | {b}))
        else:
            options += [best(r, j + 1, (cache - {v}) | {b}) for v in cache]
        return gained + max(options)

    return best(0, 0, frozenset())


def random_prefix_trace(rng: random.Random, num_nodes: int, num_requests: int) -> list[list[int]]:
    parent = {0: None} | {n: rng.randrange(0, n) if rng.random() < 0.8 else None for n in range(1, num_nodes)}
    out = []
    for _ in range(num_requests):
        node: int | None = rng.randrange(num_nodes)
        path = []
        while node is not None:
            path.append(node)
            node = parent[node]
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_the_exact_optimum_of_prefix_hits(seed: int) -> None:
    rng = random.Random(seed)
    reqs = random_prefix_trace(rng, 7, 7)
    for capacity in (1, 2, 3):
        assert belady_hit_blocks(reqs, capacity) == brute_force_best(reqs, capacity)


def test_belady_bounds_every_policy_and_meets_the_ceiling() -> None:
    t = Trace.load(TRACE, limit=1000)
    assert belady_hit_blocks(t.requests, t.unique) == t.infinite_hits
    for cap in (t.unique // 32, t.unique // 4):
        bound = belady_hit_blocks(t.requests, cap) / t.refs
        for kind in EvictionKind:
            assert one_tier(t, cap, kind.value, parents=True)["hit_ratio"] <= bound


def test_policy_benchmark_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import trace_policy

    monkeypatch.setattr(output, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(trace_policy, "RESULTS_DIR", tmp_path)
    args = ["--policy", "lru,arc", "--limit", "300", "--fractions", "1/32,1/8", "--admission", "all,seen:2",
            "--trace", str(TRACE)]
    runs = []
    for _ in range(2):
        assert trace.main(args) == 0
        runs.append(json.loads((tmp_path / "trace_policy.json").read_text())["traces"])
    assert runs[0] == runs[1]
    rows = runs[0]["conversation_trace"]["rows"]
    assert [r["fraction"] for r in rows] == ["1/32", "1/8"]
    for r in rows:
        assert r["lru"]["hit_ratio"] <= r["belady"] <= r["infinite"]
        assert r["arc+seen:2"]["written_lower"] < r["arc+all"]["written_lower"]
    assert (tmp_path / "trace_policy_conversation_trace.png").stat().st_size > 1000


def test_policy_options_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    assert trace.main(["--policy", "mru"]) == 2
    assert "choose from lru, s3fifo, arc, lfu, all" in capsys.readouterr().err
    assert trace.main(["--policy", "lru", "--admission", "tinylfu"]) == 2
    assert "a comma list of 'all' and 'seen:N'" in capsys.readouterr().err
