"""The remote rows of `kvstrata bench peer`: the remote tier against LMCache's `resp://`.

One real `redis-server` (started by the bench, on loopback) serves both sides. For each
value size (256 KiB, 2 MiB and 32 MiB: chunks of 2, 16 and 256 tokens of the Llama-3-8B
layout) each side stores the same prompts' KV (`--remote-mib` MiB) and reads it all back:
kvstrata through a remote-only `KVCacheStore` (`store()` then `flush()`, every block on the
server; `retrieve(out=)` into a faulted-in buffer), LMCache through its `RESPConnector`
(`batched_put` from its memory objects, `batched_get` into its allocator's). Each side runs
in its own process, sides alternating within each size and round, the server emptied
(FLUSHALL) before each; medians and kvstrata / LMCache ratios per size.

Both sides are measured warm, as in a running engine: LMCache's KV is copied into its memory
objects untimed (as in the disk rows), and kvstrata stores (and clears) another prompt of the
same size untimed before the timed store, so its reused record buffers are in use. What
differs, to read the ratios: kvstrata's store time includes building its records (a copy of
the KV into checksummed records, as a store from a GPU or a reused buffer must), and
kvstrata's reads verify each record's checksum, key, namespace, layout and token ids; LMCache
stores the bare bytes and checks only their length.

`--remote-connections 1,4` runs one kvstrata side per value of the tier's
`connections_per_node`, in the same rounds, each row naming its count.

Rows named "block API" time the same prompts, in the same child, through the engine API
(`store.blocks.save` then `flush()`, `store.blocks.load`) from and into contiguous block
tensors, as LMCache's memory objects are: what LMCache's side does, where `retrieve(out=)`
also scatters each value into `out`'s rows of a `[layers, 2, tokens, heads, dim]` tensor
(64 rows of 4 KiB per 256 KiB value), a copy LMCache's side leaves to a later step.

The "minimal client" column (`bench/peer_raw_resp.py`, its own child in the same rounds) is
the floor: the same bytes as bare values, pipelined on one connection by a client with no
checks and almost no Python per value.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from cli.redis_servers import RedisServer, find_redis_binary

SIZES = {"256K": 2, "2M": 16, "32M": 256}  # value size -> tokens per block (128 KiB of KV per token)
_WORKER = Path(__file__).with_name("peer_lmcache.py")


def kvstrata_side(spec: dict[str, Any]) -> dict[str, Any]:
    """One size and round of the remote tier (run in a child process)."""
    import torch

    from bench.peer_lmcache import DIM, HEADS, LAYERS, _kv, _tokens
    from kvstore import KVCacheStore, KVLayout, StoreConfig

    layout = KVLayout(LAYERS, HEADS, DIM, torch.bfloat16)
    remote = {"type": "remote", "url": spec["url"], "connections_per_node": spec.get("connections", 4)}
    cfg = StoreConfig(layout, block_size=spec["block_tokens"], tiers=[remote], namespace="peer-remote",
                      result_buffer_bytes=0)
    prompts = [(_tokens(s, spec["prompt_tokens"]), _kv(s, spec["prompt_tokens"])) for s in spec["seeds"]]
    dsts = [torch.zeros_like(kv) for _, kv in prompts]  # faulted in, as LMCache's allocator is
    with KVCacheStore(cfg) as store:
        for seed, (_, kv) in zip(spec["seeds"], prompts):  # warm: record buffers in use, as in an engine
            store.store(_tokens(1000 + seed, spec["prompt_tokens"]), kv)
        assert store.flush()
        store.clear()
        out: dict[str, Any] = {"bytes": sum(kv.numel() * kv.element_size() for _, kv in prompts)}
        t0 = time.perf_counter()
        for tokens, kv in prompts:
            store.store(tokens, kv)
        assert store.flush(), "the remote tier did not flush"
        out["write_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for (tokens, _), dst in zip(prompts, dsts):
            got = store.retrieve(tokens, out=dst).num_tokens
            assert got == len(tokens), f"the remote tier read {got} of {len(tokens)} tokens"
        out["read_s"] = time.perf_counter() - t0
        assert all(torch.equal(d.view(torch.int16), kv.view(torch.int16)) for d, (_, kv) in zip(dsts, prompts))
        out.update(_block_api(store, prompts, spec["block_tokens"]))
    return out


def _block_api(store: Any, prompts: list[tuple[Any, Any]], block_tokens: int) -> dict[str, float]:
    """The same prompts through the engine API (`store.blocks.save`/`load`) from and into
    contiguous block tensors, as LMCache's memory objects are (copied from the KV untimed, as
    LMCache's are); the namespace cleared first, untimed."""
    import torch

    store.clear()
    keys = [store.keys(tokens) for tokens, _ in prompts]
    srcs = [[kv[:, :, i * block_tokens : (i + 1) * block_tokens].contiguous() for i in range(len(k))]
            for k, (_, kv) in zip(keys, prompts)]
    dsts = [[torch.zeros_like(s) for s in blocks] for blocks in srcs]  # faulted in
    t0 = time.perf_counter()
    for k, blocks in zip(keys, srcs):
        store.blocks.save(k, blocks)
    assert store.flush(), "the remote tier did not flush"
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k, blocks in zip(keys, dsts):
        got = store.blocks.load(k, blocks).num_blocks
        assert got == len(k), f"the remote tier loaded {got} of {len(k)} blocks"
    read_s = time.perf_counter() - t0
    assert all(torch.equal(d.view(torch.int16), s.view(torch.int16))
               for ds, ss in zip(dsts, srcs) for d, s in zip(ds, ss))
    return {"blocks_write_s": write_s, "blocks_read_s": read_s}


def _child(side: str, spec: dict[str, Any], python: str) -> dict[str, Any]:
    from bench.common import child_env

    if side == "lmcache":
        cmd = [python, str(_WORKER), json.dumps({**spec, "phase": "remote"})]
    elif side == "minimal":
        cmd = [sys.executable, "-m", "bench.peer", json.dumps({**spec, "side": "minimal-remote"})]
    else:
        cmd = [sys.executable, "-m", "bench.peer", json.dumps({**spec, "side": "kvstrata-remote"})]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600)
    if done.returncode != 0:
        raise click.ClickException(f"the {side} remote side failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def side_name(connections: int, all_connections: tuple[int, ...]) -> str:
    """The kvstrata side of `connections` per node: "kvstrata" where it is the only one."""
    return "kvstrata" if len(all_connections) == 1 else f"kvstrata c={connections}"


def run(mib: int, rounds: int, lmcache: str | None, connections: tuple[int, ...] = (4,)) -> dict[str, Any] | None:
    """Every size's rounds against one `redis-server` this starts (a kvstrata side per
    `connections` per node); None (said) without one."""
    if find_redis_binary() is None:
        print("redis-server is not installed here: no remote rows")
        return None
    per_side = {side_name(c, connections): c for c in connections}
    sides = [*per_side, "minimal"] + (["lmcache"] if lmcache else [])
    tokens = max(256, mib * 8 // 256 * 256)  # 128 KiB per token, whole 32 MiB chunks
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {k: [] for k in SIZES} for s in sides}
    # No maxmemory: 8 of LMCache's 32 MiB SETs at once grow query buffers past a bound that
    # holds the data, the server evicts, and LMCache's batched_get of an evicted key hangs.
    server = RedisServer(None, "--maxmemory", "0").start()
    try:
        for r in range(rounds):
            for label, block_tokens in SIZES.items():
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    _flushall(server.url)
                    spec = {"url": server.url, "block_tokens": block_tokens, "mib": tokens // 8,
                            "seeds": [1], "prompt_tokens": tokens, "connections": per_side.get(side, 0)}
                    results[side][label].append(_child(side, spec, lmcache or sys.executable))
    finally:
        server.stop()
    return {"mib": tokens // 8, "rounds": rounds, "connections": list(connections), "results": results}


def _flushall(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def rows(remote: dict[str, Any]) -> list[list[Any]]:
    """Table rows: per size, store and read GB/s of kvstrata, LMCache and the minimal client
    (medians), and kvstrata's ratios to the other two."""
    res = remote["results"]
    out: list[list[Any]] = []

    def med(side: str, label: str, key: str) -> float:
        runs = res.get(side, {}).get(label, [])
        return statistics.median(r["bytes"] / r[key] / 1e9 for r in runs) if runs else float("nan")

    connections = tuple(remote.get("connections", [4]))
    for label in SIZES:
        for what, key in (("store", "write_s"), ("read", "read_s")):
            lm, floor = med("lmcache", label, key), med("minimal", label, key)
            for c in connections:
                side = side_name(c, connections)
                for api, prefix in (("", ""), (", block API", "blocks_")):
                    k = med(side, label, prefix + key)
                    name = f"remote {what} {label} values{api}" + ("" if side == "kvstrata" else f", {c} connections")
                    out.append([f"{name} (GB/s)", k, lm, floor, k / lm if lm == lm else "-",
                                k / floor if floor == floor else "-"])
    return out
