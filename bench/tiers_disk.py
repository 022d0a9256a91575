"""The disk rows of `kvstrata bench tiers`: stores per durability mode, reads, lookups.

Every disk figure is timed A/B against a raw file operation on the same bytes in the same
loop (raw, tier, raw, tier, ...; medians), under the same durability:
- `commit` against a raw write + `fdatasync`; `group` and `none` against a raw buffered
  write (`group` syncs later, in the background, as a raw writer that syncs now and then).
- *fill*: the tier's files emptied before each store (`clear(all_namespaces=True)`), against
  a write into a new file; *reuse*: the tier's slots freed before each store (`clear()`), so
  the store overwrites them, against a write over an existing file.
- reads: `retrieve(out=)` warm against a raw `readinto` from the page cache; cold (the slot
  files dropped from the page cache, the store reopened) against a raw read of a dropped file.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.common import drop_file_cache
from kvstore import DiskSync, KVCacheStore, KVLayout, StoreConfig

MODES = (DiskSync.COMMIT, DiskSync.GROUP, DiskSync.NONE)
Step = Callable[[], object]


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def _raw_write(path: Path, src: np.ndarray, *, sync: bool, fresh: bool) -> tuple[Step, Step]:
    """(setup, timed write) of `src` into `path`: a new file (`fresh`) or over the old one."""
    def setup() -> None:
        if fresh:
            path.unlink(missing_ok=True)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            view = memoryview(src).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    return setup, write


def _nothing() -> None:
    pass


def _ab(pairs: list[tuple[Step, Step]], repeat: int) -> list[float]:
    """Median seconds of each (untimed setup, timed step) pair, run interleaved `repeat` times."""
    times: list[list[float]] = [[] for _ in pairs]
    for _ in range(repeat):
        for i, (setup, fn) in enumerate(pairs):
            setup()
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def disk_rows(layout: KVLayout, block_size: int, kv: torch.Tensor, workdir: Path, repeat: int,
              fresh_tokens: Callable[[], list[int]], dst: torch.Tensor) -> dict[str, float]:
    """Every disk figure of one block size (see the module docstring)."""
    out: dict[str, float] = {}
    for mode in MODES:
        out.update(_mode_rows(mode, layout, block_size, kv, workdir, repeat, fresh_tokens, dst))
    (workdir / "raw.bin").unlink(missing_ok=True)
    return out


def _mode_rows(mode: DiskSync, layout: KVLayout, block_size: int, kv: torch.Tensor, workdir: Path, repeat: int,
               fresh_tokens: Callable[[], list[int]], dst: torch.Tensor) -> dict[str, float]:
    nbytes = kv.numel() * kv.element_size()
    src = kv.contiguous().view(torch.uint8).numpy().reshape(-1)
    raw, path, m = workdir / "raw.bin", workdir / f"disk-{mode.value}", mode.value
    cfg = StoreConfig(layout, block_size=block_size, cpu_bytes=0, disk_path=str(path),
                      disk_bytes=3 * nbytes + (64 << 20), disk_sync=mode)
    out: dict[str, float] = {}
    sync = mode is DiskSync.COMMIT
    pending: list[list[int]] = []
    with KVCacheStore(cfg) as store:
        def stage(wipe: bool) -> Step:
            def setup() -> None:
                store.clear(all_namespaces=wipe)
                pending.append(fresh_tokens())
            return setup

        def store_it() -> None:
            store.store(pending.pop(), kv)

        t = _ab([_raw_write(raw, src, sync=sync, fresh=True), (stage(True), store_it),
                 _raw_write(raw, src, sync=sync, fresh=False), (stage(False), store_it)], repeat)
        out[f"raw_fill_{m}_gbps"], out[f"disk_fill_{m}_gbps"] = _gbps(nbytes, t[0]), _gbps(nbytes, t[1])
        out[f"raw_reuse_{m}_gbps"], out[f"disk_reuse_{m}_gbps"] = _gbps(nbytes, t[2]), _gbps(nbytes, t[3])
        if mode is not DiskSync.NONE:
            return out
        tokens = fresh_tokens()
        store.store(tokens, kv)
        res = store.retrieve(tokens)
        assert res.kv is not None and torch.equal(res.kv.view(torch.int16), kv.view(torch.int16))
        buf = bytearray(nbytes)

        def raw_read() -> None:
            with open(raw, "rb", buffering=0) as f:
                f.readinto(buf)

        t = _ab([(_nothing, raw_read), (_nothing, lambda: store.retrieve(tokens, out=dst))], repeat)
        out["raw_read_warm_gbps"], out["disk_read_warm_gbps"] = _gbps(nbytes, t[0]), _gbps(nbytes, t[1])
    out["raw_read_cold_gbps"], out["disk_read_cold_gbps"] = _cold(cfg, path, raw, tokens, dst, nbytes, repeat)
    return out


def _cold(cfg: StoreConfig, path: Path, raw: Path, tokens: list[int], dst: torch.Tensor, nbytes: int,
          repeat: int) -> tuple[float, float]:
    """Cold reads: the files dropped from the page cache before each read (the store is
    reopened, untimed, so nothing of it is cached in the process either)."""
    buf = bytearray(nbytes)
    raw_t, disk_t = [], []
    for _ in range(repeat):
        drop_file_cache(raw)
        t0 = time.perf_counter()
        with open(raw, "rb", buffering=0) as f:
            f.readinto(buf)
        raw_t.append(time.perf_counter() - t0)
        for f in path.iterdir():
            if f.suffix in (".kvd", ".mdb"):
                drop_file_cache(f)
        with KVCacheStore(cfg) as store:
            t0 = time.perf_counter()
            got = store.retrieve(tokens, out=dst).num_tokens
            disk_t.append(time.perf_counter() - t0)
            assert got == len(tokens) // cfg.block_size * cfg.block_size
    return _gbps(nbytes, statistics.median(raw_t)), _gbps(nbytes, statistics.median(disk_t))


def lookup_rows(workdir: Path, token_counts: tuple[int, ...] = (1024, 4096), chunk: int = 256,
                repeat: int = 200) -> dict[str, dict[str, float]]:
    """`lookup()` of a prompt held on disk (Llama-3-8B layout, 256-token chunks), against
    hashing the same prompt alone (`block_hashes`, the first step of every lookup): what the
    disk probe adds."""
    return {str(n): _lookup(workdir, n, chunk, repeat) for n in token_counts}


def _lookup(workdir: Path, n: int, chunk: int, repeat: int) -> dict[str, float]:
    layout = KVLayout(32, 8, 128, torch.bfloat16)
    path = workdir / f"lookup-{n}"
    cfg = StoreConfig(layout, block_size=chunk, cpu_bytes=0, disk_path=str(path),
                      disk_bytes=n * layout.token_bytes * 2 + (64 << 20), disk_sync=False)
    tokens = np.random.default_rng(n).integers(0, 128_000, size=n).tolist()
    with KVCacheStore(cfg) as store:
        store.store(tokens, torch.zeros(layout.block_shape(n), dtype=layout.dtype))
        assert store.lookup(tokens) == n
        t = _ab([(_nothing, lambda: store.block_hashes(tokens)), (_nothing, lambda: store.lookup(tokens))], repeat)
    shutil.rmtree(path)
    return {"lookup_us": t[1] * 1e6, "hash_only_us": t[0] * 1e6, "probe_us": (t[1] - t[0]) * 1e6}
