"""Opening a filled disk tier: the in-memory copy of a namespace's hashes is built from the
index in one pass that runs no Python code per block (10^7 blocks open in seconds), and it
holds exactly that namespace's blocks whichever namespaces share the directory."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path
from types import FrameType

import numpy as np

from tests.reliability.kvgen import BLOCK, make_kv, open_store
from tiers.disk.tier import LMDBTier


def _fill(path: Path, namespace: str, prompts: int, seed: int, blocks: int = 4) -> set[bytes]:
    """Store `prompts` prompts of `blocks` blocks under `namespace`; return the hashes stored."""
    with open_store(str(path), namespace=namespace) as store:
        for i in range(prompts):
            tokens = np.random.default_rng(seed * 1000 + i).integers(0, 2**31, size=blocks * BLOCK)
            store.store(tokens, make_kv(tokens, store.config.layout, BLOCK))
        tier = store.tiers[-1]
        assert isinstance(tier, LMDBTier)
        return set(tier.held_hashes())


def test_open_reads_each_namespace_alone(tmp_path: Path) -> None:
    """Namespaces before, between and after another in key order; one never written."""
    held = {ns: _fill(tmp_path, ns, 3 + k, k) for k, ns in enumerate(("alpha", "beta", "gamma", "delta"))}
    assert all(len(h) == 4 * (3 + k) for k, h in enumerate(held.values()))
    for ns in (*held, "never-written"):
        with open_store(str(tmp_path), namespace=ns) as store:
            tier = store.tiers[-1]
            assert isinstance(tier, LMDBTier)
            assert set(tier.held_hashes()) == held.get(ns, set()), ns
            assert tier.index_syncs[0] == 1  # built from the index at open, not replayed
            tier.check_integrity()


def test_open_runs_no_python_code_per_block(tmp_path: Path) -> None:
    """The rebuild is C-level iteration: the Python calls an open makes do not grow with the
    blocks held (before: a generator resumed, a slice and a check per block)."""
    _fill(tmp_path, "other", 2, 99)  # another namespace in the same index
    _fill(tmp_path, "few", 1, 2)  # 4 blocks
    _fill(tmp_path, "many", 150, 1)  # 600 blocks
    calls = {}
    for ns in ("few", "many"):
        count = 0

        def profile(frame: FrameType, event: str, arg: object) -> None:
            nonlocal count
            count += event == "call"

        sys.setprofile(profile)
        try:
            store = open_store(str(tmp_path), namespace=ns)
        finally:
            sys.setprofile(None)
        with store:
            assert len(set(store.tiers[-1].held_hashes())) == (600 if ns == "many" else 4)
        calls[ns] = count
    assert calls["many"] - calls["few"] < 100, f"Python calls at open: {calls} (4 and 600 blocks)"


def test_the_in_memory_index_takes_under_40_bytes_a_block(tmp_path: Path) -> None:
    """What an open allocates grows by under 40 bytes per block held: the compact set's 16
    bytes of hash and up to 2 of directory (a Python set of bytes took 90-110)."""
    _fill(tmp_path, "few", 1, 2)  # 4 blocks
    _fill(tmp_path, "many", 16, 1, blocks=256)  # 4,096 blocks
    traced = {}
    for ns in ("few", "many", "few", "many"):  # (the second round: imports and caches warm)
        gc.collect()
        tracemalloc.start()
        try:
            store = open_store(str(tmp_path), namespace=ns)
            gc.collect()
            traced[ns] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        with store:
            assert len(set(store.tiers[-1].held_hashes())) == (4096 if ns == "many" else 4)
            store.check_integrity()
    per_block = (traced["many"] - traced["few"]) / (4096 - 4)
    assert per_block < 40, f"the open allocates {per_block:.0f} bytes per block held"
