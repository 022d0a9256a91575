"""`kvstrata bench hints`: multi-turn sessions that pause (tool calls) under a flood of one-shot
requests, through a real store's CPU tier: the session turns' hit ratio with `retain` hints on
the sessions, and with the flood sent at `priority` "low" instead, against the same store
without hints (under LRU, S3-FIFO and ARC), Belady's offline optimum on the same replay, and
an infinite cache.

Each round, every session sends its whole context so far plus a few new blocks (a turn);
between two turns of a session come the other sessions' turns and `--flood` one-shot
requests. A request reads its longest cached prefix (`retrieve`), then is stored; with hints,
a session turn is then retained for `--retain-s` seconds (`KVCacheStore.retain`, within
`StoreConfig.retain_share` of the CPU tier); with the low hint, each one-shot request is instead
stored and then given `KVCacheStore.prioritize(tokens, "low")`. Belady sees the same block references and the
whole future (`bench/trace_sim.py`); its session-turn hits are those of the cache that
maximises all hits. The gap closed is (hints - no hints) / (Belady - no hints).
"""

from __future__ import annotations

from collections.abc import Iterator

import click
import numpy as np
import torch

from bench.trace_sim import belady_hits
from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results
from kvstore import KVCacheStore, KVLayout, StoreConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)
BLOCK = 16
POLICIES = ("lru", "s3fifo", "arc")  # the CPU tier's eviction, with and without hints


def workload(sessions: int, rounds: int, context_blocks: int, turn_blocks: int, flood: int, flood_blocks: int,
             seed: int) -> list[tuple[bool, list[int]]]:
    """The requests in order, each (is a session turn, token ids)."""
    rng = np.random.default_rng(seed)
    contexts = [rng.integers(1, 1 << 30, context_blocks * BLOCK).tolist() for _ in range(sessions)]
    out: list[tuple[bool, list[int]]] = []
    for _ in range(rounds):
        for s in range(sessions):
            contexts[s] = contexts[s] + rng.integers(1, 1 << 30, turn_blocks * BLOCK).tolist()
            out.append((True, list(contexts[s])))
            for _ in range(flood // sessions):
                out.append((False, rng.integers(1, 1 << 30, flood_blocks * BLOCK).tolist()))
    return out


def _block_ids(requests: list[tuple[bool, list[int]]]) -> Iterator[list[int]]:
    """Each request's full blocks as ints, one per distinct prefix (what the chained hashes mean)."""
    ids: dict[tuple[int, ...], int] = {}
    for _, tokens in requests:
        yield [ids.setdefault(tuple(tokens[: (i + 1) * BLOCK]), len(ids)) for i in range(len(tokens) // BLOCK)]


def replay(requests: list[tuple[bool, list[int]]], cpu_blocks: int, retain_s: float | None, share: float,
           policy: str, low_flood: bool = False) -> int:
    """Session-turn hit blocks through a real store's CPU tier under eviction `policy` (with
    `retain` after each session turn when `retain_s`; each one-shot request given priority
    "low" when `low_flood`)."""
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK), retain_share=share,
                      cpu_eviction=policy)
    hits = 0
    with KVCacheStore(cfg) as store:
        for is_session, tokens in requests:
            got = store.retrieve(tokens).num_tokens // BLOCK
            hits += got if is_session else 0
            store.store(tokens, torch.zeros(LAYOUT.block_shape(len(tokens)), dtype=LAYOUT.dtype))
            if is_session and retain_s is not None:
                store.retain(tokens, retain_s)
            if not is_session and low_flood:
                store.prioritize(tokens, "low")
    return hits


def run(sessions: int, rounds: int, context_blocks: int, turn_blocks: int, flood: int, flood_blocks: int,
        cpu_blocks: list[int], retain_s: float, share: float, seed: int) -> dict[str, object]:
    requests = workload(sessions, rounds, context_blocks, turn_blocks, flood, flood_blocks, seed)
    blocks = list(_block_ids(requests))
    session_refs = sum(len(b) for (s, _), b in zip(requests, blocks) if s)
    seen: set[int] = set()
    infinite = 0
    for (s, _), ids in zip(requests, blocks):
        n = next((i for i, b in enumerate(ids) if b not in seen), len(ids))
        infinite += n if s else 0
        seen.update(ids)
    rows, results = [], {}
    for cap in cpu_blocks:
        best = sum(h for (s, _), h in zip(requests, belady_hits(blocks, cap)) if s)
        for policy in POLICIES:
            plain = replay(requests, cap, None, share, policy)
            hinted = replay(requests, cap, retain_s, share, policy)
            low = replay(requests, cap, None, share, policy, low_flood=True)
            closed, closed_low = ((h - plain) / (best - plain) if best > plain else float("nan") for h in (hinted, low))
            results[f"{policy}/{cap}"] = {"no_hints": plain / session_refs, "retain": hinted / session_refs,
                                          "low_flood": low / session_refs, "belady": best / session_refs,
                                          "infinite": infinite / session_refs, "gap_closed": closed,
                                          "gap_closed_low": closed_low}
            rows.append([policy, cap, plain / session_refs, hinted / session_refs, low / session_refs,
                         best / session_refs, infinite / session_refs, closed, closed_low])
    print_table(f"Session turns' block hit ratio: {sessions} sessions x {rounds} turns, {flood} one-shot requests "
                f"of {flood_blocks} blocks per round; retain {retain_s:g} s within {share:g} of the CPU tier",
                ["policy", "CPU blocks", "no hints", "retain hints", "low flood", "Belady", "infinite",
                 "gap closed (retain)", "gap closed (low)"], rows)
    return {"sessions": sessions, "rounds": rounds, "session_block_refs": session_refs, "results": results}


@click.command("hints", help=__doc__, context_settings=CONTEXT)
@click.option("--sessions", type=positive(), default=8, show_default=True)
@click.option("--rounds", type=positive(), default=12, show_default=True)
@click.option("--context-blocks", type=positive(), default=24, show_default=True)
@click.option("--turn-blocks", type=positive(), default=2, show_default=True)
@click.option("--flood", type=click.IntRange(min=0), default=48, show_default=True, help="one-shot requests per round")
@click.option("--flood-blocks", type=positive(), default=16, show_default=True)
@click.option("--cpu-blocks", default="256,384,512", show_default=True, help="CPU tier sizes to replay")
@click.option("--retain-s", type=click.FloatRange(min=0.001, max=86400), default=3600.0, show_default=True)
@click.option("--share", type=click.FloatRange(min=0.001, max=1.0), default=0.75, show_default=True,
              help="StoreConfig.retain_share")
@click.option("--seed", type=int, default=1, show_default=True)
def command(sessions: int, rounds: int, context_blocks: int, turn_blocks: int, flood: int, flood_blocks: int,
            cpu_blocks: str, retain_s: float, share: float, seed: int) -> None:
    try:
        sizes = [int(x) for x in cpu_blocks.split(",")]
    except ValueError:
        raise click.BadParameter(f"must be comma-separated integers, got {cpu_blocks!r}",
                                 param_hint="--cpu-blocks") from None
    if any(n < 1 for n in sizes):
        raise click.BadParameter(f"sizes must be positive, got {cpu_blocks!r}", param_hint="--cpu-blocks")
    write_results("hints", run(sessions, rounds, context_blocks, turn_blocks, flood, flood_blocks, sizes, retain_s,
                               share, seed))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench hints")
