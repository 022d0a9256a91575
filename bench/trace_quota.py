"""`kvstrata bench trace --policy ... --quota`: one tenant's burst against another's working set.

The traces carry no tenants, so two are made deterministically: tenant A replays the trace;
tenant B, in the middle third of it, sends `--flood-x` requests after each of A's, each of
fresh blocks never used again (a batch job with unique prompts, under its own cache salt),
their lengths drawn from the trace's with `--seed`. One tier of the given capacity, in three
runs: A alone; A and B without quotas; A and B with a quota of half the tier each. Reports A's
block hit ratio over the whole trace and over the flood, and the blocks each tenant holds
when the flood ends.
"""

from __future__ import annotations

import random
from fractions import Fraction

from bench.trace_policy import NAMES, Trace
from bench.trace_sim import SimTier, Stack
from cli.output import print_table

TENANT_A = b"tenant-a"
TENANT_B = b"tenant-b"


def schedule(trace: Trace, flood_x: int, seed: int) -> list[tuple[bytes, list[int]]]:
    """The requests of both tenants in arrival order (B's ids start above every trace id)."""
    rng = random.Random(seed)
    lengths = [len(ids) for ids in trace.requests]
    next_id = max(b for ids in trace.requests for b in ids) + 1
    n = len(trace.requests)
    out: list[tuple[bytes, list[int]]] = []
    for i, ids in enumerate(trace.requests):
        out.append((TENANT_A, ids))
        if n // 3 <= i < 2 * n // 3:
            for _ in range(flood_x):
                length = rng.choice(lengths)
                out.append((TENANT_B, list(range(next_id, next_id + length))))
                next_id += length
    return out


def replay_tenants(trace: Trace, requests: list[tuple[bytes, list[int]]], capacity: int, policy: str,
                   quota_blocks: int | None) -> dict[str, float]:
    tier = SimTier(capacity, policy, quota_blocks=quota_blocks)
    stack = Stack([tier], [])
    hits = refs = flood_hits = flood_refs = 0
    a_seen = 0
    n = len(trace.requests)
    held_at_flood_end: dict[str, int] = {}
    for tenant, ids in requests:
        got = stack.serve(ids, tenant)
        if tenant == TENANT_A:
            hits += got
            refs += len(ids)
            if n // 3 <= a_seen < 2 * n // 3:
                flood_hits += got
                flood_refs += len(ids)
            a_seen += 1
            if a_seen == 2 * n // 3:
                held = [tier.res.tenant_of(b) for b in tier.res.order()]
                held_at_flood_end = {"a": held.count(TENANT_A), "b": held.count(TENANT_B)}
    tier.res.check_integrity()
    return {"a_hit_ratio": hits / refs, "a_hit_ratio_during_flood": flood_hits / flood_refs if flood_refs else 0.0,
            "a_blocks_at_flood_end": held_at_flood_end.get("a", 0),
            "b_blocks_at_flood_end": held_at_flood_end.get("b", 0)}


def run_quota(trace: Trace, fraction: Fraction, policy: str, flood_x: int, seed: int) -> dict[str, object]:
    cap = trace.capacity(fraction)
    alone = replay_tenants(trace, [(TENANT_A, ids) for ids in trace.requests], cap, policy, None)
    both = schedule(trace, flood_x, seed)
    free = replay_tenants(trace, both, cap, policy, None)
    quota = replay_tenants(trace, both, cap, policy, cap // 2)
    rows = {"alone": alone, "flood_no_quota": free, "flood_quota_half": quota}
    print_table(f"{trace.name}: tenant A's hit ratio when tenant B floods, one {NAMES[policy]} tier of {cap} blocks "
                f"({fraction} of unique), B sends {flood_x} one-off requests per A request in the middle third",
                ["run", "A hit ratio", "A hit ratio during the flood", "A blocks held", "B blocks held"],
                [[name, r["a_hit_ratio"], r["a_hit_ratio_during_flood"], int(r["a_blocks_at_flood_end"]),
                  int(r["b_blocks_at_flood_end"])] for name, r in rows.items()])
    return {"fraction": str(fraction), "capacity_blocks": cap, "policy": policy, "flood_x": flood_x, "seed": seed,
            "quota_blocks": cap // 2, "runs": rows}
