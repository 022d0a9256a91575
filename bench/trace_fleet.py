"""`kvstrata bench trace --policy ... --fleet N`: the fleet replay with a shared tier per policy.

Requests go round-robin to N simulated hosts (a router that knows nothing of KV), as in
`bench/fleet.py`, but over `bench/trace_sim.py`: each host has one tier of the given capacity
and all share one remote tier of `--lower-x` host capacities, written through with every
request and sent each host's evictions, every tier under the policy measured. Per policy and
admission (on the write-through path and the demotions alike): block hit ratio, the hits the
shared tier served, and the blocks written into it; the same hosts without a shared tier,
and an infinite cache, for reference.
"""

from __future__ import annotations

from fractions import Fraction

from bench.trace_policy import NAMES, Trace
from bench.trace_sim import SimTier, Stack
from cli.output import print_table
from cli.progress import tqdm


def replay_fleet(trace: Trace, hosts: int, capacity: int, remote_capacity: int | None, policy: str,
                 admission: str, parents: bool) -> dict[str, float]:
    known = trace.parents if parents else None
    remote = None if remote_capacity is None else SimTier(remote_capacity, policy, parents=known)
    stacks = []
    for _ in range(hosts):
        top = SimTier(capacity, policy, demote_admission=admission, below=remote, parents=known)
        stacks.append(Stack([top] if remote is None else [top, remote], [] if remote is None else [remote],
                            admit_through=True))
    hits = sum(stacks[i % hosts].serve(ids) for i, ids in enumerate(trace.requests))
    return {"hit_ratio": hits / trace.refs,
            "hits_remote": 0 if remote is None else remote.num_hits,
            "written_remote": 0 if remote is None else remote.num_puts}


def run_fleet_policies(trace: Trace, hosts: int, fraction: Fraction, lower_x: int, policies: list[str],
                       admissions: list[str], parents: bool, block_gib: float) -> dict[str, object]:
    cap = trace.capacity(fraction)
    remote_cap = lower_x * cap
    rows = []
    table = []
    runs = [(p, a) for p in policies for a in admissions]
    for policy, admission in tqdm(runs, desc=f"fleet of {hosts}", leave=False, disable=None):
        local = replay_fleet(trace, hosts, cap, None, policy, "all", parents)
        shared = replay_fleet(trace, hosts, cap, remote_cap, policy, admission, parents)
        rows.append({"policy": policy, "admission": admission, "local": local, "shared": shared})
        table.append([NAMES[policy], admission, local["hit_ratio"], shared["hit_ratio"],
                      int(shared["hits_remote"]), shared["written_remote"] * block_gib])
    print_table(f"{trace.name}: fleet of {hosts} hosts (round-robin), {cap} blocks each ({fraction} of unique), "
                f"shared tier of {remote_cap} blocks; infinite cache {trace.infinite_hits / trace.refs:.3f}",
                ["policy", "admission", "local tiers only", "with the shared tier", "shared-tier hits",
                 "GiB written to the shared tier"], table)
    return {"hosts": hosts, "fraction": str(fraction), "capacity_blocks": cap, "remote_blocks": remote_cap,
            "infinite_hit_ratio": trace.infinite_hits / trace.refs, "rows": rows}
