"""The shared-filesystem tier across processes standing for hosts, on a real directory: hosts
read each other's prefixes; a writer killed mid-file leaves no partial block and its
temporary file is removed later; hosts evicting at once keep the directory near capacity and
never remove a file kvstrata did not write; a write the kernel refuses (RLIMIT_FSIZE) is a
counted drop. Each host is its own Python process (`sharedfs_host.py`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVCacheStore
from tests import ROOT
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.sharedfs_host import BIG, open_store, shared_tier, tokens
from tiers.keys import BlockKey
from tiers.shared.record import parse_record
from tiers.sharedfs import files


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _host(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.tiers.sharedfs_host", *map(str, args)], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _kvstrata_files(root: Path) -> list[files.Entry]:
    found = []
    for ns in files.namespace_dirs(str(root)):
        for path, aa in files.shard_dirs(ns):
            found += list(files.scan_shard(path, aa))
    return found


def test_hosts_read_each_others_prefixes(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    hosts = [_host("share", root, i, 3) for i in range(3)]
    results = [_result(p) for p in hosts]
    for r in results:  # 2 other hosts x 3 prompts x 4 blocks, all from the shared directory
        assert r == {"blocks_read": 24, "from_shared": 24, "corrupt": 0}


def test_a_writer_killed_mid_file_leaves_no_partial_block_and_its_temp_file_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    temps: list[files.Entry] = []
    whole = BIG.block_bytes(BLOCK)
    for _ in range(5):  # a kill can land between a write's end and its rename, or between files: try again
        proc = _host("write-forever", root)
        assert proc.stdout is not None and "started" in proc.stdout.readline()
        deadline = time.monotonic() + 30  # a writer stores block after block: wait to see one half written
        while time.monotonic() < deadline and not any(e.block_hash is None and e.size < whole
                                                       for e in _kvstrata_files(root)):
            pass
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        temps = [e for e in _kvstrata_files(root) if e.block_hash is None]
        if any(e.size < whole for e in temps):
            break
    assert any(e.size < whole for e in temps), "no writer was killed mid-file in 5 tries"
    blocks = [e for e in _kvstrata_files(root) if e.block_hash is not None]
    for e in blocks:  # every visible block is whole: its record checks
        assert e.block_hash is not None
        parse_record(Path(e.path).read_bytes(), e.block_hash)
    with open_store(str(root), layout=BIG, local=False, orphan_after_s=3600) as store:
        tier = shared_tier(store)
        tier.space.scan()
        assert all(os.path.exists(e.path) for e in temps), "a young temporary file is a writer's: kept"
        assert tier.space.num_orphans_removed == 0
        if blocks:  # a visible block reads back whole through the tier
            dst = torch.empty(BIG.block_shape(BLOCK), dtype=BIG.dtype)
            assert tier.get_into([BlockKey(blocks[0].block_hash)], [dst]) == 1
    time.sleep(0.2)
    with open_store(str(root), layout=BIG, local=False, orphan_after_s=0.1) as store:
        shared_tier(store).space.scan()  # as the first scan does, in the background
        assert not any(os.path.exists(e.path) for e in temps)
        assert shared_tier(store).space.num_orphans_removed >= len(temps)


def _foreign(root: Path) -> list[Path]:
    """Files kvstrata did not write, where its own are (some named almost as its own)."""
    ns = root / files.namespace_dir_name(b"elsewhere" * 2)
    paths = [root / "README", root / ("0" * 32) / "notes.txt", ns / "ab" / "cd" / ("ee" * 16 + ".kvb"),
             ns / "ab" / "cd" / ".abcd0000.host.1.0123456789abcdef.tmp.keep", ns / "ab" / "cd" / "x.tmp"]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"not kvstrata's" * 100)
        os.utime(p, (1, 1))  # older than anything: first in line if eviction looked at it
    return paths


def test_hosts_evicting_at_once_keep_the_directory_near_capacity_and_foreign_files(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    foreign = _foreign(root)
    record = LAYOUT.block_bytes(BLOCK) + 512
    capacity = 60 * record
    hosts = [_host("fill", root, capacity, 40, seed) for seed in range(3)]  # 3 x 160 blocks into 60
    results = [_result(p) for p in hosts]
    # A write the queue has no room for is a counted drop (a busy machine slows the writers),
    # never an error; most of the 480 blocks are written all the same.
    assert all(r["errors"] == 0 and r["drops"] < 160 for r in results), results
    assert sum(r["evicted"] for r in results) > 0
    used = sum(e.size for e in _kvstrata_files(root) if e.block_hash is not None)
    # In flight each host overshoots by what the others wrote since its last scan (no host
    # holds a lock the others wait on): bounded by the hosts' number, not exact.
    assert 0.3 * capacity <= used <= 3.0 * capacity, (used, capacity)
    assert all(p.exists() for p in foreign), "eviction removed a file kvstrata did not write"
    with open_store(str(root), local=False, capacity_bytes=capacity) as store:
        for _ in range(5):  # any host's next scans (each bounded, from a cursor) bring it back under
            shared_tier(store).space.maintain(force_scan=True)
    used = sum(e.size for e in _kvstrata_files(root) if e.block_hash is not None)
    assert 0.3 * capacity <= used <= capacity, (used, capacity)
    assert all(p.exists() for p in foreign), "eviction removed a file kvstrata did not write"
    with open_store(str(root), local=False) as store:
        store.clear()
        shared_tier(store).sweep(all_namespaces=True)
    assert not [e for e in _kvstrata_files(root) if e.block_hash is not None]
    assert all(p.exists() for p in foreign), "a clear removed a file kvstrata did not write"


def test_a_write_the_kernel_refuses_is_a_counted_drop_and_leaves_no_file(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    r = _result(_host("fsize", root, 1024))  # every record is longer than 1 KiB: EFBIG
    assert r["drops"] == 4 and r["errors"] >= 4 and r["retrieved_tokens"] == 0, r
    assert r["files"] == [], "a refused write left its temporary file"


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_a_full_filesystem_is_a_counted_drop_and_reads_stay_exact(tmp_path: Path) -> None:
    """A real ENOSPC: a 64 KiB tmpfs (skipped where it cannot be mounted, e.g. not root)."""
    mnt = tmp_path / "tmpfs"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open_store(str(mnt), local=False, capacity_bytes=1 << 30) as store:  # the budget is not what stops it
            prompts = [tokens(seed, blocks=4) for seed in range(8)]  # 32 x 4 KiB records into 64 KiB
            for t in prompts:
                store.store(t, make_kv(t, LAYOUT, BLOCK))  # never raises
            tier = shared_tier(store)
            assert tier.num_write_drops > 0 and tier.num_errors > 0
            held = 0
            for t in prompts:
                res = store.retrieve(t)
                held += check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
            assert 0 < held < 32
            assert not [e for e in _kvstrata_files(mnt) if e.block_hash is None], "no temporary file left behind"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_store_of_a_host_with_its_own_tiers_uses_config_alone(tmp_path: Path) -> None:
    store: KVCacheStore = open_store(str(tmp_path / "shared"))
    try:
        assert [t.kind for t in store.tiers] == ["pool", "cpu", "sharedfs"]
        assert store.tiers[-1].traits.shared and store.tiers[-1].traits.persistent
        assert store.tiers[-1].identity == f"sharedfs:{os.path.realpath(tmp_path / 'shared')}"
    finally:
        store.close()
