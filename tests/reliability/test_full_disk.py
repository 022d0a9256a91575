"""A full disk: the `disk_bytes` budget, LMDB's map size, and the file system's free space.

In every case the store either evicts or refuses the write whole with `DiskFullError`, keeps
serving reads bit-exact, leaves no half-written entry (every record validates, the tier's
accounting holds), and can be closed and reopened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import DiskFullError, KVCacheStore, KVLayout
from tiers.disk.tier import LMDBTier

from . import procs
from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, check_kv, make_kv, open_store
from .workers import fill_until_full

# 128 KiB blocks fill a map quickly.
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)


def _disk(store: KVCacheStore) -> LMDBTier:
    tier = store.tiers[-1]
    assert isinstance(tier, LMDBTier)
    return tier


def _prompt(rng: np.random.Generator, num_blocks: int, block: int = BLOCK) -> np.ndarray:
    return rng.integers(0, 2**32, size=num_blocks * block, dtype=np.uint32)


def test_disk_bytes_budget_evicts_and_never_overflows(tmp_path: Path, figures: Figures) -> None:
    rng = np.random.default_rng([BUDGET.seed, 30])
    capacity = 512 << 10
    store = open_store(str(tmp_path), disk_bytes=capacity)
    try:
        disk = _disk(store)
        for _ in range(BUDGET.count(150)):
            tokens = _prompt(rng, int(rng.integers(1, 7)))
            assert store.store(tokens, make_kv(tokens, LAYOUT, BLOCK)) == len(tokens)
            stats = disk.stats()
            assert stats.used_bytes <= capacity
            res = store.retrieve(tokens)  # the newest prompt is always whole
            assert check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK) == len(tokens) // BLOCK
        assert disk.stats().num_evictions > 0
        # One prompt larger than the whole tier: its prefix is kept, its tail never enters.
        huge = _prompt(rng, 3 * disk.capacity_blocks)
        kept = store.store(huge, make_kv(huge, LAYOUT, BLOCK))
        assert 0 < kept < len(huge)
        res = store.retrieve(huge)
        assert res.num_tokens == kept
        check_kv(huge, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert disk.stats().used_bytes <= capacity
        assert disk.scrub().num_corrupt == 0
        store.check_integrity()
        figures.set("evictions", disk.stats().num_evictions)
    finally:
        store.close()


_READER = """
import lmdb, sys
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=4)
txn = env.begin()  # a snapshot that pins every page it can see
print("ready", flush=True)
sys.stdin.read()
"""


def test_map_full_under_a_stale_reader(tmp_path: Path, figures: Figures) -> None:
    """A reader holding one snapshot stops LMDB from reusing freed pages, so the map fills
    however much is evicted: writes are refused with DiskFullError, reads go on, and once the
    reader is SIGKILLed (leaving its slot in LMDB's reader table) writes succeed again."""
    rng = np.random.default_rng([BUDGET.seed, 31])
    store = open_store(str(tmp_path), layout=BIG, disk_bytes=1 << 20)
    reader = None
    try:
        kept = _prompt(rng, 2)
        store.store(kept, make_kv(kept, BIG, BLOCK))
        reader = subprocess.Popen([sys.executable, "-c", _READER, str(tmp_path)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        num_stored = 0
        newest = kept
        with pytest.raises(DiskFullError, match="map full"):
            for _ in range(10_000):
                tokens = _prompt(rng, 4)
                store.store(tokens, make_kv(tokens, BIG, BLOCK))
                newest = tokens
                num_stored += 1
        refused = tokens
        assert num_stored > 0
        assert store.lookup(refused) == 0, "a refused write left blocks behind"
        res = store.retrieve(newest)  # the newest stored prompt is whole and exact
        assert check_kv(newest, res.kv, res.num_tokens, BIG, BLOCK) == 4
        assert _disk(store).scrub().num_corrupt == 0
        store.check_integrity()
        os.kill(reader.pid, signal.SIGKILL)
        reader.wait()
        reader = None
        assert store.store(refused, make_kv(refused, BIG, BLOCK)) == len(refused)
        res = store.retrieve(refused)
        assert check_kv(refused, res.kv, res.num_tokens, BIG, BLOCK) == 4
        store.check_integrity()
        figures.set("stores_before_refusal", num_stored)
    finally:
        if reader is not None:
            reader.kill()
            reader.wait()
        store.close()


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 6 MiB tmpfs, or a skip where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    where = Path(f"/tmp/kvstrata-fullfs-{uuid.uuid4().hex[:8]}")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def _fill_and_check(path: str, report: Path, figures: Figures, how: str) -> None:
    spec = {"path": path, "seed": BUDGET.seed, "report": str(report)}
    if how == "rlimit":
        spec["fsize_limit"] = 6 << 20
    proc = procs.context().Process(target=fill_until_full, args=(spec,))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == 0, procs.error_of(spec["report"])
    report = procs.read_json(spec["report"])
    assert report["refused"] >= 1
    assert report["error"].startswith("disk tier at")
    reason = "file system full" if how == "tmpfs" else "file size limit"
    assert reason in report["error"], report["error"]
    figures.set("stores_before_refusal", report["stored"])
    figures.set("refusals", report["refused"])
    figures.set("blocks_verified_after", report["blocks_verified"])


def test_file_system_full_on_tmpfs(small_tmpfs: Path, tmp_path: Path, figures: Figures) -> None:
    """ENOSPC from a 6 MiB tmpfs under a 64 MiB `disk_bytes`."""
    _fill_and_check(str(small_tmpfs / "disk"), tmp_path / "report.json", figures, "tmpfs")


def test_file_size_limit(tmp_path: Path, figures: Figures) -> None:
    """EFBIG from RLIMIT_FSIZE in a child: the file-system-full path wherever mount is denied."""
    _fill_and_check(str(tmp_path / "disk"), tmp_path / "report.json", figures, "rlimit")


def test_close_on_a_nearly_full_disk_persists_what_fits(small_tmpfs: Path) -> None:
    """`close()` spilling a CPU tier larger than the free space
    used to persist nothing (one put failing whole) and raised `DiskFullError` from
    `__exit__`. Now the most recently used blocks go first, the rest are counted, and close
    returns its report instead of raising."""
    from kvstore import CloseResult

    from .kvgen import BLOCK, LAYOUT, check_kv, make_kv, open_store

    path = str(small_tmpfs / "disk")
    rng = np.random.default_rng([BUDGET.seed, 66])
    prompts = [rng.integers(0, 50_000, size=8 * BLOCK, dtype=np.uint32) for _ in range(500)]  # ~16 MiB of KV
    store = open_store(path, cpu_bytes=4200 * LAYOUT.block_bytes(BLOCK), disk_bytes=64 << 20)
    for tokens in prompts:
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    result = store.close()
    assert isinstance(result, CloseResult)
    assert result.num_spilled > 0 and result.num_refused > 0, result
    with open_store(path, disk_bytes=64 << 20) as reopened:
        newest = prompts[-1]
        res = reopened.retrieve(newest)
        assert res.num_tokens == len(newest)  # the most recently stored survived
        check_kv(newest, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert reopened.lookup(prompts[0]) < len(prompts[0])  # the oldest did not fit
        reopened.check_integrity()
