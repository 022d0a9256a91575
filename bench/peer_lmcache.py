"""The LMCache side of `kvstrata bench peer`, run by an interpreter that has LMCache installed.

Standalone on purpose (LMCache and its torch may live in another environment than
kvstrata): it imports neither kvstrata nor anything of this repository. Usage:
`python bench/peer_lmcache.py '{"phase": "run", "dir": ..., "tokens": [...], ...}'`; prints
one JSON line. Drives LMCache's own local-disk backend (`LocalDiskBackend` over a
`LocalCPUBackend` allocator) and its chunked token database, the layers its engine uses for
`store`/`lookup`/`retrieve` of 256-token chunks, with the same KV bytes as the kvstrata side.
Phase "remote": LMCache's `resp://` connector (`RESPConnector`, its native multi-threaded RESP
client) on a server at `spec["url"]`: `batched_put` of every chunk of `block_tokens` tokens,
then `batched_get` of them all, the calls its remote backend makes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

LAYERS, HEADS, DIM, CHUNK = 32, 8, 128, 256  # Llama-3-8B, bf16: 128 KiB of KV per token


def _kv(seed: int, num_tokens: int) -> torch.Tensor:
    """The KV both sides store: [L, 2, T, H, D] bf16 random bits from `seed`."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (LAYERS, 2, num_tokens, HEADS, DIM), generator=g, dtype=torch.int32)
    return bits.to(torch.int16).view(torch.bfloat16)


def _tokens(seed: int, num_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, 128_000, (num_tokens,), generator=g).tolist()


def _open(spec: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase

    gib = spec["mib"] / 1024
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=gib + 1,
                                               local_disk=spec["dir"], max_local_disk_size=3 * gib + 1)
    meta = LMCacheMetadata(model_name="peer", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(config, meta)
    return LocalDiskBackend(config, loop, cpu), cpu, ChunkedTokenDatabase(config, meta), loop


def _lookup(disk: Any, db: Any, tokens: list[int]) -> int:
    """Leading tokens held: LMCache's engine lookup (hash the chunks, probe each)."""
    hit = 0
    for _, end, key in db.process_tokens(tokens=tokens):
        if not disk.contains(key):
            break
        hit = end
    return hit


def _memory_objects(db: Any, cpu: Any, spec: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Every prompt's chunks copied into LMCache's memory objects (untimed, as its engine
    does), and their keys."""
    from lmcache.v1.memory_management import MemoryFormat

    objs, keys = [], []
    for seed in spec["seeds"]:
        tokens = _tokens(seed, spec["prompt_tokens"])
        kv = _kv(seed, len(tokens))
        for start, end, key in db.process_tokens(tokens=tokens):
            obj = cpu.allocate(torch.Size([2, LAYERS, end - start, HEADS * DIM]), torch.bfloat16, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(kv[:, :, start:end].permute(1, 0, 2, 3, 4).reshape(obj.tensor.shape))
            objs.append(obj)
            keys.append(key)
    return objs, keys


def run(spec: dict[str, Any]) -> dict[str, Any]:
    disk, cpu, db, _ = _open(spec)
    out: dict[str, Any] = {}
    prompts = [(s, _tokens(s, spec["prompt_tokens"])) for s in spec["seeds"]]
    objs, keys = _memory_objects(db, cpu, spec)
    nbytes = sum(o.get_physical_size() for o in objs)
    t0 = time.perf_counter()
    for key, obj in zip(keys, objs):
        disk.submit_put_task(key, obj)
    while any(disk.exists_in_put_tasks(k) for k in keys):
        time.sleep(0.0002)
    out["write_s"], out["bytes"] = time.perf_counter() - t0, nbytes
    for obj in objs:
        obj.ref_count_down()
    for n in spec["lookup_tokens"]:
        tokens = prompts[0][1][:n]
        assert _lookup(disk, db, tokens) == n
        times = []
        for _ in range(spec["lookups"]):
            t0 = time.perf_counter()
            _lookup(disk, db, tokens)
            times.append(time.perf_counter() - t0)
        out[f"lookup_{n}_us"] = statistics.median(times) * 1e6
    t0 = time.perf_counter()
    got = [disk.get_blocking(k) for k in keys]
    out["read_s"] = time.perf_counter() - t0
    assert all(g is not None for g in got)
    for g in got:
        g.ref_count_down()
    disk.close()
    return out


def remote(spec: dict[str, Any]) -> dict[str, Any]:
    """Store, then read back, every chunk of the prompts through LMCache's `resp://` connector."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.redis_connector import RESPConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase

    chunk = spec["block_tokens"]
    gib = spec["mib"] / 1024
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=False, max_local_cpu_size=2 * gib + 1,
                                               remote_url=spec["url"].replace("redis://", "resp://"),
                                               remote_serde="naive")
    meta = LMCacheMetadata(model_name="peer", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, chunk, HEADS, DIM), chunk_size=chunk)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(config, meta)
    db = ChunkedTokenDatabase(config, meta)
    host, port = spec["url"].removeprefix("redis://").split(":")
    conn = RESPConnector(host, int(port), loop, cpu)

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    objs, keys = _memory_objects(db, cpu, spec)
    sources = [obj.tensor.clone() for obj in objs]
    out: dict[str, Any] = {"bytes": sum(o.get_physical_size() for o in objs)}
    t0 = time.perf_counter()
    call(conn.batched_put(keys, objs))
    out["write_s"] = time.perf_counter() - t0
    for obj in objs:
        obj.ref_count_down()
    t0 = time.perf_counter()
    got = call(conn.batched_get(keys))
    out["read_s"] = time.perf_counter() - t0
    assert len(got) == len(keys) and all(torch.equal(g.tensor.view(torch.int16), s.view(torch.int16))
                                         for g, s in zip(got, sources)), "LMCache read back other bytes"
    # no conn.close(): its executor's shutdown blocks the loop it runs on (the process exits instead)
    return out


def restart(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh process on the same directory: how many of the first prompt's tokens hit."""
    disk, _, db, _ = _open(spec)
    tokens = _tokens(spec["seeds"][0], spec["prompt_tokens"])
    hit = _lookup(disk, db, tokens)
    disk.close()
    return {"restart_hit_tokens": hit}


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    request = json.loads(sys.argv[1])
    phases = {"run": run, "restart": restart, "remote": remote}
    result = phases[request["phase"]](request)
    print(json.dumps(result), flush=True)
    os._exit(0)  # LMCache's event-loop threads would keep the interpreter alive
