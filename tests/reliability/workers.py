"""Functions that run in child processes (see `procs.py`); they report through JSON files."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import KVCacheStore
from tiers.disk.tier import LMDBTier

from .kvgen import BLOCK, LAYOUT, PromptPool, check_kv, full_blocks, make_kv, open_store
from .procs import write_json


@dataclass(frozen=True)
class CrashSpec:
    """One round of the crash test: reopen + verify, then store until killed."""

    disk_path: str
    journal_path: str
    report_path: str
    round_index: int
    seed: int
    num_prompts: int
    durable: bool  # every committed prompt must come back whole (no eviction)
    store_kwargs: dict[str, Any] = field(default_factory=dict)
    verify_only: bool = False
    num_sampled: int = 40
    newest_whole: bool = True  # the last committed prompt reached disk before the kill


def _guarded(fn: Any, report_path: str, *args: Any) -> None:
    try:
        fn(*args)
    except BaseException:
        Path(f"{report_path}.err").write_text(traceback.format_exc())
        raise


def parse_journal(path: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(begun, committed) entries as (round, prompt); a torn last line is ignored."""
    begun: list[tuple[int, int]] = []
    committed: list[tuple[int, int]] = []
    if not os.path.exists(path):
        return begun, committed
    data = Path(path).read_text()
    for line in data.split("\n")[:-1]:  # the text after the last newline may be torn
        kind, r, j = line.split()
        (begun if kind == "B" else committed).append((int(r), int(j)))
    return begun, committed


def disk_tier(store: KVCacheStore) -> LMDBTier:
    tier = store.tiers[-1]
    assert isinstance(tier, LMDBTier)
    return tier


def verify_store(store: KVCacheStore, spec: CrashSpec, pool: PromptPool) -> dict[str, int]:
    """Check what the journal says was stored; return counts. Raises AssertionError."""
    begun, committed = parse_journal(spec.journal_path)
    rng = np.random.default_rng([spec.seed, 3, spec.round_index])
    committed_set = {j for _, j in committed}
    order: list[int] = []
    if committed:
        order.append(committed[-1][1])  # the newest commit first: it must be whole
    last_round = begun[-1][0] if begun else -1
    order += sorted({j for r, j in begun if r == last_round})
    older = sorted({j for _, j in begun})
    if spec.verify_only:
        order += older
    elif older:
        order += [int(j) for j in rng.choice(older, size=min(spec.num_sampled, len(older)))]
    num_blocks = num_whole = 0
    for pos, j in enumerate(order):
        tokens = pool.prompt(j)
        res = store.retrieve(tokens)
        num_blocks += check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        must_be_whole = (spec.durable and j in committed_set) or (pos == 0 and committed and spec.newest_whole)
        if must_be_whole:
            assert res.num_tokens == full_blocks(tokens), (
                f"committed prompt {j} lost blocks: {res.num_tokens}/{full_blocks(tokens)} tokens"
            )
            num_whole += 1
    scrub = disk_tier(store).scrub()
    assert scrub.num_corrupt == 0, f"{scrub.num_corrupt} damaged records after a crash"
    store.check_integrity()
    return {
        "prompts_checked": len(order), "blocks_verified": num_blocks,
        "committed_whole": num_whole, "records_scrubbed": scrub.num_ok,
    }


def crash_round(spec: CrashSpec) -> None:
    _guarded(_crash_round, spec.report_path, spec)


def _crash_round(spec: CrashSpec) -> None:
    pool = PromptPool(spec.seed, spec.num_prompts)
    t0 = time.perf_counter()
    store = open_store(spec.disk_path, **spec.store_kwargs)
    report: dict[str, Any] = {"open_s": time.perf_counter() - t0}
    report.update(verify_store(store, spec, pool))
    report["verify_s"] = time.perf_counter() - t0
    if spec.verify_only:
        store.close()
        write_json(spec.report_path, report)
        return
    write_json(spec.report_path, report)
    rng = np.random.default_rng([spec.seed, 2, spec.round_index])
    fd = os.open(spec.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    r = spec.round_index
    i = 0
    while True:  # until SIGKILL
        j = int(rng.integers(spec.num_prompts))
        tokens = pool.prompt(j)
        os.write(fd, f"B {r} {j}\n".encode())
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        os.write(fd, f"C {r} {j}\n".encode())
        i += 1
        if i % 4 == 0:  # reads between writes: their recency updates ride the next commit
            k = int(rng.integers(spec.num_prompts))
            other = pool.prompt(k)
            res = store.retrieve(other)
            check_kv(other, res.kv, res.num_tokens, LAYOUT, BLOCK)


def fill_until_full(spec: dict[str, Any]) -> None:
    _guarded(_fill_until_full, spec["report"], spec)


def _fill_until_full(spec: dict[str, Any]) -> None:
    """Store until the file system refuses; check reads, integrity, close and reopen."""
    import resource
    import signal

    from kvstore import DiskFullError

    if "fsize_limit" in spec:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], spec["fsize_limit"]))
    rng = np.random.default_rng([spec["seed"], 32])
    store = open_store(spec["path"], disk_bytes=64 << 20, disk_sync=True)
    stored: list[np.ndarray] = []
    refused = 0
    error = ""
    for _ in range(100_000):
        tokens = rng.integers(0, 2**32, size=4 * BLOCK, dtype=np.uint32)
        try:
            store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        except DiskFullError as exc:
            error = str(exc)
            refused += 1
            assert store.lookup(tokens) == 0, "a refused write left blocks behind"
            if refused == 3:
                break
            continue
        stored.append(tokens)
    assert refused == 3, "the file system never filled"
    num_blocks = 0
    for tokens in stored:  # every write that returned is still there, bit-exact
        res = store.retrieve(tokens)
        num_blocks += check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert res.num_tokens == len(tokens)
    assert disk_tier(store).scrub().num_corrupt == 0
    store.check_integrity()
    store.close()  # flushing recency updates must not fail on a full disk
    store = open_store(spec["path"], disk_bytes=64 << 20, disk_sync=True)
    res = store.retrieve(stored[-1])
    check_kv(stored[-1], res.kv, res.num_tokens, LAYOUT, BLOCK)
    store.check_integrity()
    store.close()
    write_json(spec["report"], {"stored": len(stored), "refused": refused, "error": error,
                                "blocks_verified": num_blocks})


def shared_dir_worker(spec: dict[str, Any]) -> None:
    _guarded(_shared_dir_worker, spec["report"], spec)


def _shared_dir_worker(spec: dict[str, Any]) -> None:
    """Store (writers) and retrieve/look up (everyone) on a shared directory for a while."""
    pool = PromptPool(spec["seed"], 512, num_roots=8)
    extra = {"cpu_bytes": 64 * LAYOUT.block_bytes(BLOCK), "write_through": True}
    store = open_store(spec["disk_path"], **(extra if spec["with_cpu"] else {}))
    rng = np.random.default_rng([spec["seed"], 41, spec["index"]])
    fd = os.open(spec["journal"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    time.sleep(max(0.0, spec["start_at"] - time.time()))
    deadline = time.monotonic() + spec["seconds"]
    ops = blocks = 0
    max_read = 0.0
    while time.monotonic() < deadline:
        j = int(rng.integers(pool.num_prompts))
        tokens = pool.prompt(j)
        if spec["writer"] and rng.random() < 0.5:
            store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
            os.write(fd, f"{j}\n".encode())
        elif rng.random() < 0.8:
            t0 = time.perf_counter()
            res = store.retrieve(tokens)
            max_read = max(max_read, time.perf_counter() - t0)
            blocks += check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        else:
            n = store.lookup(tokens)
            assert n % BLOCK == 0 and n <= len(tokens)
        ops += 1
    os.close(fd)
    store.check_integrity()
    store.close()
    write_json(spec["report"], {"ops": ops, "blocks_verified": blocks,
                                "max_read_ms": 1000 * max_read})
