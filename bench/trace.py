"""Replay a Mooncake-format trace through kvstrata's tiers: hit ratio against pool capacity.

Run: `kvstrata bench trace [--trace PATH] [--fractions 1/32,1/16,1/8,1/4]` (default: the
packaged conversation trace; `bench/traces/synthetic_trace.jsonl.gz` is the other one). Each request
lists `hash_ids` of 512-token blocks (equal ids = equal prefix blocks). Every id becomes
512 deterministic token ids, so the real store (chained hashing, pool, CPU and LMDB tiers,
their LRU and promotion) decides every hit. Each request retrieves its longest cached
prefix, then stores all its blocks, one request at a time (no concurrency: a request's
blocks are not held while others run). The payload stored is tiny; bytes moved are
reported at a realistic block size (`--token-kib`, default 128 KiB/token: Llama-3-8B in bf16,
i.e. 64 MiB per 512-token block). Three configurations per pool size:
(a) GPU-only LRU prefix cache (the vLLM baseline), (b) kvstrata with a CPU tier of
`--cpu-x` pools and a disk tier of `--disk-x` pools, (c) an infinite cache (the ceiling).

With `--policy lru,s3fifo,arc,lfu` (or `all`) it replays the eviction and admission policies
instead, on both packaged traces unless `--trace` is given, at capacities from 1/64 to 1/2 of
the unique blocks, with Belady's optimum and LRU in the same run (bench/trace_policy.py); with
`--fleet N` the shared tier of a fleet under each policy, with `--quota` one tenant's flood
against another's quota, with `--cost N` the CPU tier's cost per block under each policy.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from bench.common import pyplot, save_plot
from cli.args import CONTEXT, Choices, existing_file, invoke, nonneg, positive
from cli.output import RESULTS_DIR, print_table, write_results
from cli.progress import tqdm
from kvstore import KVCacheStore, KVLayout, StoreConfig
from kvstore.errors import ConfigError, KVStoreError
from tiers.keys import TierKind
from tiers.policies.admission import parse_admission
from tiers.policies.eviction import EvictionKind

TRACE_BLOCK_TOKENS = 512
DEFAULT_FRACTIONS = "1/64,1/32,1/16,1/8,1/4,1/2"  # of the policy replay
# The Mooncake traces ship inside the package (gzip, Apache-2.0: bench/traces/NOTICE).
TRACES_DIR = Path(__file__).resolve().parent / "traces"
DEFAULT_TRACE = TRACES_DIR / "conversation_trace.jsonl.gz"
_LAYOUT = KVLayout(1, 1, 1, torch.float16)  # 4 bytes per token: the tier logic runs, the bytes are tiny


class TraceError(KVStoreError, ValueError):
    """A trace file that is not a Mooncake trace (the one line names the file and line)."""


def load_trace(path: str | Path, limit: int | None = None) -> list[list[int]]:
    """The `hash_ids` of each request, in arrival order. Raises `TraceError` naming the file
    and line of a record that is not JSON with a non-empty list of non-negative integer
    `hash_ids`, and for a trace with no request."""
    out = []
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    out.append(_hash_ids(line, f"{path} line {number}"))
                    if limit is not None and len(out) >= limit:
                        break
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path} is not a readable Mooncake trace (.jsonl or .jsonl.gz): {exc}") from None
    if not out:
        raise TraceError(f"{path} holds no request")
    return out


def _hash_ids(line: str, where: str) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where} is not JSON ({exc})") from None
    ids = record.get("hash_ids") if isinstance(record, dict) else None
    if not (isinstance(ids, list) and ids and all(type(i) is int and 0 <= i < 2**63 for i in ids)):
        raise TraceError(f"{where}: a Mooncake record needs \"hash_ids\", a non-empty list of non-negative "
                         f"integers; got {str(record)[:80]}")
    return ids


def tokens_for(hash_ids: list[int]) -> np.ndarray:
    """512 token ids per block id; distinct ids give distinct blocks."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    return ((ids[:, None] * TRACE_BLOCK_TOKENS + np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)) % (2**32)).astype(
        np.uint32
    ).ravel()


def infinite_hits(requests: list[list[int]]) -> tuple[int, int]:
    """(prefix-hit block references, all block references) for an unbounded cache."""
    seen: set[int] = set()
    hits = refs = 0
    for ids in requests:
        refs += len(ids)
        for i in ids:
            if i not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits, refs


def serve_request(store: KVCacheStore, ids: list[int], payload: torch.Tensor, hits: dict[TierKind, int]) -> int:
    """One trace request: retrieve its longest cached prefix (counting hits per tier into
    `hits`), then store all its blocks. Returns its block references."""
    toks = tokens_for(ids)
    res = store.retrieve(toks)
    for kind, n in res.blocks_per_tier.items():
        hits[kind] += n
    store.store(toks, payload[:, :, : len(toks)])
    return len(ids)


def replay(requests: list[list[int]], pool_blocks: int, cpu_blocks: int, disk_blocks: int,
           workdir: Path, desc: str) -> dict[str, float]:
    """Replay through a real store; return hits per tier, references and blocks written per tier."""
    block_bytes = _LAYOUT.block_bytes(TRACE_BLOCK_TOKENS)
    disk = workdir / f"disk-{pool_blocks}-{cpu_blocks}-{disk_blocks}"
    cfg = StoreConfig(
        _LAYOUT, block_size=TRACE_BLOCK_TOKENS, namespace="trace", pool_blocks=pool_blocks, pool_device="cpu",
        cpu_bytes=cpu_blocks * block_bytes, disk_path=str(disk) if disk_blocks else None,
        disk_bytes=max(2, disk_blocks) * (block_bytes + 8192) + (1 << 20), disk_sync=False, verify_tokens=False,
        persist_on_close=False,
    )
    hits = {k: 0 for k in TierKind}
    refs = 0
    longest = max(len(ids) for ids in requests) * TRACE_BLOCK_TOKENS
    payload = torch.zeros(_LAYOUT.block_shape(longest), dtype=_LAYOUT.dtype)  # sliced per request
    with KVCacheStore(cfg) as store:
        for ids in tqdm(requests, desc=desc, leave=False, disable=None):
            refs += serve_request(store, ids, payload, hits)
        stats = {t.kind: t.stats() for t in store.tiers}
        store.check_integrity()
    shutil.rmtree(disk, ignore_errors=True)
    out: dict[str, float] = {"refs": refs, "hit_ratio": sum(hits.values()) / refs}
    for kind in TierKind:
        out[f"hits_{kind.value}"] = hits[kind]
        out[f"written_{kind.value}"] = stats[kind].num_puts if kind in stats else 0
    return out


def parse_fractions(text: str) -> list[Fraction]:
    return [Fraction(s.strip()) for s in text.split(",") if s.strip()]


def plot(path: Path, rows: list[dict[str, float]], title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    x = [r["pool_blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, [r["gpu_only_hit_ratio"] for r in rows], "o-", label="GPU-only LRU (vLLM baseline)")
    ax.plot(x, [r["tiered_hit_ratio"] for r in rows], "s-", label="kvstrata: pool + CPU + disk")
    ax.plot(x, [r["infinite_hit_ratio"] for r in rows], "k--", label="infinite cache (ceiling)")
    ax.set_xscale("log")
    ax.set_xlabel("pool capacity (512-token blocks)")
    ax.set_ylabel("block hit ratio")
    save_plot(fig, ax, path, title)
    return True


def run(trace: str, fractions: list[Fraction], cpu_x: int, disk_x: int, token_kib: int,
        limit: int | None = None) -> dict[str, object]:
    requests = load_trace(trace, limit)
    unique = len({i for ids in requests for i in ids})
    inf_hits, refs = infinite_hits(requests)
    block_gib = token_kib * TRACE_BLOCK_TOKENS / 2**20
    rows = []
    table = []
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-trace-"))
    try:
        for frac in fractions:
            pool = max(1, int(unique * frac))
            gpu = replay(requests, pool, 0, 0, tmp, f"GPU-only {frac}")
            tiered = replay(requests, pool, cpu_x * pool, disk_x * pool, tmp, f"tiered {frac}")
            row = {
                "fraction_of_unique": float(frac), "pool_blocks": pool, "pool_gib": pool * block_gib,
                "gpu_only_hit_ratio": gpu["hit_ratio"], "tiered_hit_ratio": tiered["hit_ratio"],
                "infinite_hit_ratio": inf_hits / refs,
                "tiered_hits": {k.value: tiered[f"hits_{k.value}"] for k in TierKind},
                "tiered_gib_served": {k.value: tiered[f"hits_{k.value}"] * block_gib for k in TierKind},
                "tiered_gib_written": {k.value: tiered[f"written_{k.value}"] * block_gib for k in TierKind},
                "gpu_only_gib_served": gpu["hits_pool"] * block_gib,
            }
            rows.append(row)
            served = row["tiered_gib_served"]
            table.append([str(frac), pool, row["pool_gib"], gpu["hit_ratio"], tiered["hit_ratio"], inf_hits / refs,
                          tiered["hit_ratio"] / gpu["hit_ratio"] if gpu["hit_ratio"] else float("inf"),
                          served["pool"], served["cpu"], served["disk"]])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    name = Path(trace).name.removesuffix(".gz").removesuffix(".jsonl")
    print_table(
        f"Trace replay: {name}, {len(requests)} requests, {unique} unique 512-token blocks; "
        f"CPU tier {cpu_x}x pool, disk {disk_x}x pool; GiB at {token_kib} KiB/token",
        ["pool/unique", "pool blocks", "pool GiB", "GPU-only", "tiered", "infinite", "tiered/GPU-only",
         "GiB from pool", "GiB from CPU", "GiB from disk"], table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / f"trace_{name}.png"
    if plot(png, rows, f"{name}: hit ratio vs pool capacity (CPU {cpu_x}x, disk {disk_x}x pool)"):
        print(f"plot written to {png}")
    return {"trace": str(trace), "num_requests": len(requests), "unique_blocks": unique, "block_refs": refs,
            "cpu_x": cpu_x, "disk_x": disk_x, "token_kib": token_kib, "rows": rows, "plot": str(png)}


class Fractions(click.ParamType):
    name = "fractions"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[Fraction]:
        if isinstance(value, list):
            return value
        try:
            out = parse_fractions(str(value))
        except (ValueError, ZeroDivisionError):
            self.fail(f"{value!r} is not a comma list of fractions such as 1/16", param, ctx)
        if not out or not all(0 < f <= 1 for f in out):
            self.fail(f"{value!r}: each fraction must be in (0, 1]", param, ctx)
        return out


POLICY_CHOICES = [k.value for k in EvictionKind]


class AdmissionList(click.ParamType):
    name = "list"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):
            return value
        items = [x.strip() for x in str(value).split(",") if x.strip()]
        try:
            specs = [str(parse_admission(x, "--admission")) for x in items]
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        if not specs or any(a == "tinylfu" for a in specs):
            self.fail(f"{value!r}: a comma list of 'all' and 'seen:N' (N in 2..15)", param, ctx)
        return specs


@click.command("trace", help=__doc__, context_settings=CONTEXT)
@click.option("--trace", "trace_paths", type=existing_file(), multiple=True,
              help="a Mooncake trace (.jsonl or .jsonl.gz); repeat for several (default: the packaged "
                   "conversation trace; with --policy, both packaged traces)")
@click.option("--fractions", type=Fractions(), default=None,
              help="pool sizes (with --policy: tier sizes) as fractions of unique blocks "
                   f"[default: 1/32,1/16,1/8,1/4; with --policy {DEFAULT_FRACTIONS}]")
@click.option("--cpu-x", type=nonneg(), default=4, show_default=True, help="CPU tier size in pools")
@click.option("--disk-x", type=nonneg(), default=16, show_default=True, help="disk tier size in pools")
@click.option("--token-kib", type=positive(), default=128, show_default=True,
              help="KV KiB per token for byte accounting")
@click.option("--limit", type=positive(), default=None, help="replay only the first N requests")
@click.option("--fleet", type=positive(), default=None,
              help="replay on N hosts round-robin, with and without a shared remote tier (bench/fleet.py; "
                   "with --policy: simulated, the shared tier under each policy)")
@click.option("--remote-url", default=None, help="with --fleet: the remote tier (default: a loopback redis-server)")
@click.option("--shared-tier", "shared_tier", default=None, metavar="JSON",
              help='with --fleet: any shared tier\'s config instead of the remote tier, e.g. {"type": "sharedfs", '
                   '"path": "/mnt/kv", "capacity_bytes": 68719476736} (a sharedfs tier without a path: a temporary '
                   'directory)')
@click.option("--policy", "policies", type=Choices([*POLICY_CHOICES, "all"]), default=None,
              help="replay the eviction policies instead (comma list, or all), with Belady's optimum and LRU; "
                   "simulated over the shipped policy classes (bench/trace_policy.py)")
@click.option("--admission", "admissions", type=AdmissionList(), default="all,seen:2", show_default=True,
              help="with --policy: demotion admissions to compare, the first the baseline")
@click.option("--lower-x", type=positive(), default=4, show_default=True,
              help="with --policy: the tier below (disk, or the fleet's shared tier) in tier capacities")
@click.option("--parents/--no-parents", default=False, show_default=True,
              help="with --policy: keys name their parent block (prefix links), as the store's keys will")
@click.option("--quota", is_flag=True, help="with --policy: the two-tenant flood experiment (bench/trace_quota.py)")
@click.option("--flood-x", type=positive(), default=2, show_default=True,
              help="with --quota: one-off requests of the flooding tenant per request of the other")
@click.option("--seed", type=nonneg(), default=0, show_default=True, help="with --quota: the flood's lengths")
@click.option("--cost", "cost_rounds", type=positive(), default=None,
              help="with --policy: time the CPU tier under each policy against LRU in N interleaved rounds of a "
                   "real store (bench/trace_cost.py; --limit defaults to 2000 requests)")
def command(trace_paths: tuple[str, ...], fractions: list[Fraction] | None, cpu_x: int, disk_x: int, token_kib: int,
            limit: int | None, fleet: int | None, remote_url: str | None, shared_tier: str | None,
            policies: list[str] | None, admissions: list[str], lower_x: int, parents: bool, quota: bool,
            flood_x: int, seed: int, cost_rounds: int | None) -> None:
    if policies is not None:
        run_policy_mode(list(trace_paths), fractions, policies, admissions, lower_x, token_kib, limit, parents,
                        fleet, quota, flood_x, seed, cost_rounds)
        return
    trace_path = trace_paths[0] if trace_paths else str(DEFAULT_TRACE.resolve())
    fractions = fractions or parse_fractions("1/32,1/16,1/8,1/4")
    name = Path(trace_path).name.removesuffix(".gz").removesuffix(".jsonl")
    if remote_url is not None and fleet is None:
        from tiers.remote.tier import redacted

        raise click.UsageError(f"--remote-url {redacted(remote_url)!r} needs --fleet N")
    shared = _shared_tier_option(shared_tier, fleet, remote_url)
    if fleet is not None:
        from bench.fleet import run_fleet

        requests = load_trace(trace_path, limit)
        unique = len({i for ids in requests for i in ids})
        pool = max(1, int(unique * fractions[0]))
        suffix = "" if shared is None else f"_{shared['type']}"
        write_results(f"fleet_{name}{suffix}", run_fleet(requests, fleet, pool, cpu_x * pool, remote_url, shared))
        return
    write_results(f"trace_{name}", run(trace_path, fractions, cpu_x, disk_x, token_kib, limit))


def _shared_tier_option(value: str | None, fleet: int | None, remote_url: str | None) -> dict[str, Any] | None:
    """`--shared-tier`'s JSON as a tier config dict (checked: one clear error), or None."""
    if value is None:
        return None
    if fleet is None or remote_url is not None:
        raise click.UsageError("--shared-tier needs --fleet N, and takes the place of --remote-url")
    try:
        config = json.loads(value)
    except ValueError:
        config = None
    if not isinstance(config, dict) or "type" not in config:
        raise click.UsageError(f"--shared-tier {value!r}: a tier config as a JSON object with its \"type\"")
    from tiers.tier_config import tier_config

    probe = {**config, "path": config.get("path", "/tmp")} if config.get("type") == "sharedfs" else config
    if not tier_config(probe, "--shared-tier").tier.traits.shared:
        raise click.UsageError(f"--shared-tier {value!r}: the {config['type']!r} tier is not shared by hosts")
    return config


def run_policy_mode(trace_paths: list[str], fractions: list[Fraction] | None, policies: list[str],
                    admissions: list[str], lower_x: int, token_kib: int, limit: int | None, parents: bool,
                    fleet: int | None, quota: bool, flood_x: int, seed: int, cost_rounds: int | None) -> None:
    """`--policy`: the policy study, or with `--fleet` / `--quota` / `--cost` one of the others."""
    from bench.trace_policy import Trace, run_policies

    if "all" in policies:
        policies = POLICY_CHOICES
    policies = list(dict.fromkeys(policies))
    paths = trace_paths or [str(TRACES_DIR / f"{n}_trace.jsonl.gz") for n in ("conversation", "synthetic")]
    fractions = fractions or parse_fractions(DEFAULT_FRACTIONS)
    block_gib = token_kib * TRACE_BLOCK_TOKENS / 2**20
    if cost_rounds is not None:
        from bench.trace_cost import run_cost

        trace = Trace.load(paths[0], limit or 2000)
        write_results(f"trace_cost_{trace.name}", run_cost(trace, policies, cost_rounds))
        return
    if fleet is not None or quota:
        for path in paths:
            trace = Trace.load(path, limit)
            if fleet is not None:
                from bench.trace_fleet import run_fleet_policies

                write_results(f"trace_fleet_{trace.name}", run_fleet_policies(
                    trace, fleet, fractions[0], lower_x, policies, admissions, parents, block_gib))
            if quota:
                from bench.trace_quota import run_quota

                write_results(f"trace_quota_{trace.name}", run_quota(trace, fractions[0], policies[0], flood_x, seed))
        return
    write_results("trace_policy", run_policies(paths, fractions, policies, admissions, lower_x, token_kib, limit,
                                               parents))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench trace")
