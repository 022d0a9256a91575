"""`kvstrata bench trace --policy ...`: eviction and admission policies on the Mooncake traces.

For each trace and each capacity (a fraction of the trace's unique blocks), in one run:
- one tier of that capacity under every policy asked (`tiers/policies/eviction.py`, through
  `bench/trace_sim.py`, which drives the shipped classes), with Belady's offline optimum as
  the upper bound and LRU as the baseline: block hit ratio, the share of the LRU-to-Belady gap
  each policy closes, and the blocks written into the tier;
- the same tier over a lower tier (`--lower-x` capacities, the disk) under every policy and
  every demotion admission asked (`tiers/policies/admission.py`): hit ratio, blocks written into each
  tier, and the disk writes admission saves against admitting all.
Hit ratios count prefix hits: a request hits its longest cached prefix. Results are
deterministic (no randomness in the replay; the admission sketch hashes deterministically).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from bench.common import pyplot, save_plot
from bench.trace import TRACE_BLOCK_TOKENS, infinite_hits, load_trace
from bench.trace_sim import SimTier, Stack, belady_hit_blocks, parents_of
from cli.output import RESULTS_DIR, print_table
from cli.progress import tqdm
from tiers.policies.admission import AdmissionSpec
from tiers.policies.eviction import EvictionKind

NAMES = {"lru": "LRU", "s3fifo": "S3-FIFO", "arc": "ARC", "lfu": "LFU"}


@dataclass
class Trace:
    """A loaded trace and what every replay of it shares."""

    name: str
    requests: list[list[int]]
    unique: int
    refs: int
    infinite_hits: int
    parents: dict[int, int | None]

    @classmethod
    def load(cls, path: str | Path, limit: int | None = None) -> Trace:
        requests = load_trace(path, limit)
        hits, refs = infinite_hits(requests)
        name = Path(path).name.removesuffix(".gz").removesuffix(".jsonl")
        return cls(name, requests, len({b for ids in requests for b in ids}), refs, hits, parents_of(requests))

    def capacity(self, fraction: Fraction) -> int:
        return max(1, int(self.unique * fraction))


def replay(trace: Trace, stack: Stack) -> int:
    """Serve every request of the trace; return the block hits."""
    return sum(stack.serve(ids) for ids in trace.requests)


def one_tier(trace: Trace, capacity: int, policy: str, parents: bool) -> dict[str, float]:
    tier = SimTier(capacity, policy, parents=trace.parents if parents else None)
    hits = replay(trace, Stack([tier], []))
    tier.res.check_integrity()
    return {"hit_ratio": hits / trace.refs, "written_blocks": tier.num_puts, "stranded": tier.res.num_stranded}


def two_tier(trace: Trace, capacity: int, lower: int, policy: str, admission: str,
             parents: bool) -> dict[str, float]:
    known = trace.parents if parents else None
    disk = SimTier(lower, policy, parents=known)
    top = SimTier(capacity, policy, demote_admission=admission, below=disk, parents=known)
    hits = replay(trace, Stack([top, disk], []))
    return {"hit_ratio": hits / trace.refs, "hits_top": top.num_hits, "hits_lower": disk.num_hits,
            "written_top": top.num_puts, "written_lower": disk.num_puts,
            "refused": top.admission.num_refused}


def study(trace: Trace, fractions: list[Fraction], policies: list[str], admissions: list[str], lower_x: int,
          parents: bool) -> list[dict[str, object]]:
    """Every measurement of one trace, one row per capacity."""
    rows: list[dict[str, object]] = []
    steps = len(fractions) * (1 + len(policies) * (1 + len(admissions)))
    with tqdm(total=steps, desc=trace.name, leave=False, disable=None) as bar:
        for frac in fractions:
            cap = trace.capacity(frac)
            row: dict[str, object] = {"fraction": str(frac), "capacity_blocks": cap,
                                      "belady": belady_hit_blocks(trace.requests, cap) / trace.refs,
                                      "infinite": trace.infinite_hits / trace.refs}
            bar.update(1)
            for policy in policies:
                row[policy] = one_tier(trace, cap, policy, parents)
                bar.update(1)
                for admission in admissions:
                    row[f"{policy}+{admission}"] = two_tier(trace, cap, lower_x * cap, policy, admission, parents)
                    bar.update(1)
            rows.append(row)
    return rows


def gap_closed(row: dict[str, object], policy: str) -> float:
    """The share of the LRU-to-Belady gap `policy` closes at this capacity (0 when no gap)."""
    lru = row["lru"]["hit_ratio"]  # type: ignore[index]
    gap = float(row["belady"]) - lru  # type: ignore[arg-type]
    return (row[policy]["hit_ratio"] - lru) / gap if gap > 1e-12 else 0.0  # type: ignore[index]


def report(trace: Trace, rows: list[dict[str, object]], policies: list[str], admissions: list[str],
           lower_x: int, block_gib: float) -> None:
    title = (f"Policy replay: {trace.name}, {len(trace.requests)} requests, {trace.unique} unique blocks: "
             "block hit ratio of one tier")
    heads = ["capacity", "blocks", *[NAMES[p] for p in policies], "Belady", "infinite"]
    if "lru" in policies:
        heads += [f"{NAMES[p]} gap closed" for p in policies if p != "lru"]
    table = []
    for r in rows:
        line: list[object] = [r["fraction"], r["capacity_blocks"], *[r[p]["hit_ratio"] for p in policies],  # type: ignore[index]
                              r["belady"], r["infinite"]]
        if "lru" in policies:
            line += [f"{100 * gap_closed(r, p):.0f}%" for p in policies if p != "lru"]
        table.append(line)
    print_table(title, heads, table)
    heads = ["capacity", "policy", "admission", "hit ratio", "GiB to top", "GiB to lower", "lower writes saved"]
    table = []
    for r in rows:
        for p in policies:
            base = r[f"{p}+{admissions[0]}"]["written_lower"]  # type: ignore[index]
            for a in admissions:
                m = r[f"{p}+{a}"]
                saved = 1 - m["written_lower"] / base if base else 0.0  # type: ignore[index]
                table.append([r["fraction"], NAMES[p], a, m["hit_ratio"], m["written_top"] * block_gib,  # type: ignore[index]
                              m["written_lower"] * block_gib, f"{100 * saved:.0f}%"])  # type: ignore[index]
    print_table(f"{trace.name}: a tier over a lower tier of {lower_x}x its capacity; demotion admission "
                f"(savings against {admissions[0]})", heads, table)


def plot(path: Path, rows: list[dict[str, object]], policies: list[str], title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    x = [float(Fraction(str(r["fraction"]))) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, marker in zip(policies, "os^vD"):
        ax.plot(x, [r[policy]["hit_ratio"] for r in rows], f"{marker}-", label=NAMES[policy])  # type: ignore[index]
    ax.plot(x, [r["belady"] for r in rows], "k--", label="Belady (offline optimum)")
    ax.plot(x, [r["infinite"] for r in rows], "k:", label="infinite cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([str(r["fraction"]) for r in rows])
    ax.minorticks_off()
    ax.set_xlabel("capacity / unique blocks")
    ax.set_ylabel("block hit ratio (prefix hits)")
    save_plot(fig, ax, path, title)
    return True


def run_policies(trace_paths: list[str], fractions: list[Fraction], policies: list[str], admissions: list[str],
                 lower_x: int, token_kib: int, limit: int | None, parents: bool) -> dict[str, object]:
    """The whole study; prints its tables, writes a plot per trace; returns the JSON payload."""
    block_gib = token_kib * TRACE_BLOCK_TOKENS / 2**20
    admissions = [str(AdmissionSpec() if a == "all" else a) for a in admissions]
    out: dict[str, object] = {"fractions": [str(f) for f in fractions], "policies": policies,
                              "admissions": admissions, "lower_x": lower_x, "token_kib": token_kib,
                              "parents": parents, "default": EvictionKind.LRU.value, "traces": {}}
    for path in trace_paths:
        trace = Trace.load(path, limit)
        rows = study(trace, fractions, policies, admissions, lower_x, parents)
        report(trace, rows, policies, admissions, lower_x, block_gib)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        png = RESULTS_DIR / f"trace_policy_{trace.name}.png"
        if plot(png, rows, policies, f"{trace.name}: hit ratio vs capacity, one tier per policy"):
            print(f"plot written to {png}")
        out["traces"][trace.name] = {  # type: ignore[index]
            "num_requests": len(trace.requests), "unique_blocks": trace.unique, "block_refs": trace.refs,
            "rows": rows, "plot": str(png)}
    return out
