"""The disk tier's format 2: slot files and the LMDB index, the in-memory index kept in step
across processes, durability modes, the space of freed slots, old directories."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvstore import ConfigError, DiskSync, StoreConfig
from tests import ROOT
from tests.reliability import diskdamage
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv, open_store
from tiers.disk import env as lmdb_env
from tiers.disk.index import LOG_KEEP, pack_entry
from tiers.disk.tier import LMDBTier, bytes_per_block
from tiers.keys import BlockHash, BlockKey

SHAPE = LAYOUT.block_shape(BLOCK)


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint32)


def _disk(store: object) -> LMDBTier:
    tier = store.tiers[-1]  # type: ignore[attr-defined]
    assert isinstance(tier, LMDBTier)
    return tier


def test_old_format_directory_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=1 << 20)
    blocks = env.open_db(b"blocks")
    for name in (b"atime", b"lru", b"meta"):
        env.open_db(name)
    with env.begin(write=True) as txn:
        txn.put(b"k" * 16, b"KVS1 a record of the first format", db=blocks)
    env.close()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir() if p.name != "lock.mdb"}
    with pytest.raises(ConfigError, match="first on-disk format") as err:
        open_store(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "move that directory away" in str(err.value)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir() if p.name != "lock.mdb"}
    assert after == before  # nothing written, no slot file created
    assert not lmdb_env._ENVS


_OTHER_PROCESS = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv, open_store
    store = open_store(sys.argv[1])
    if sys.argv[3] == "store-and-discard":
        t = np.arange(3 * BLOCK, dtype=np.uint32) + 7
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        gone = np.arange(2 * BLOCK, dtype=np.uint32) + 1000
        store.tiers[-1].discard(store.block_hashes(gone))
    else:  # many small write transactions: more than the change log keeps
        for i in range(int(sys.argv[4])):
            t = np.arange(BLOCK, dtype=np.uint32) + 10_000 + i * BLOCK
            store.store(t, make_kv(t, LAYOUT, BLOCK))
    store.close()
    """
)


def _other(path: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(path), str(ROOT), *args], check=True, timeout=300)


def test_lookups_follow_writes_of_another_process(tmp_path: Path) -> None:
    """A store's in-memory index follows another process's adds and deletes through the
    change log (no rebuild), and rebuilds once that process wrote more than the log keeps."""
    gone = np.arange(2 * BLOCK, dtype=np.uint32) + 1000
    with open_store(str(tmp_path)) as store:
        store.store(gone, make_kv(gone, LAYOUT, BLOCK))
        disk = _disk(store)
        assert disk.index_syncs[0] == 1  # built at open
        added = np.arange(3 * BLOCK, dtype=np.uint32) + 7
        assert store.lookup(added) == 0
        _other(tmp_path, "store-and-discard")
        assert store.lookup(added) == 3 * BLOCK and store.lookup(gone) == 0
        rebuilds, replayed = disk.index_syncs
        assert rebuilds == 1 and replayed >= 2
        res = store.retrieve(added)
        check_kv(added, res.kv, res.num_tokens, LAYOUT, BLOCK)
        _other(tmp_path, "many", str(LOG_KEEP + 5))
        last = np.arange(BLOCK, dtype=np.uint32) + 10_000 + (LOG_KEEP + 4) * BLOCK
        assert store.lookup(last) == BLOCK and store.lookup(added) == 3 * BLOCK
        assert disk.index_syncs[0] == 2
        assert len(set(disk.held_hashes())) == len(disk)
        store.check_integrity()


def test_held_keys_come_roots_first_with_parents_extras_and_tokens(tmp_path: Path) -> None:
    tier = LMDBTier(str(tmp_path), 64 * bytes_per_block(LAYOUT.block_bytes(BLOCK)), SHAPE, LAYOUT.dtype, sync=False)
    try:
        def h(i: int) -> BlockHash:
            return BlockHash(i.to_bytes(16, "little"))

        seed = b"s" * 16  # a first block's parent is the namespace seed
        # two chains, 1 <- 2 <- 3 and 10 <- 11, stored in scrambled order (tail first); block 20
        # without its extras (as a block demoted without KV events): held, not announceable
        chain = [(3, 2), (11, 10), (2, 1), (10, 0), (1, 0)]
        keys = [BlockKey(h(i), i.to_bytes(4, "little") * BLOCK, bytes(h(p)) if p else seed,
                         b"" if i != 11 else b"\x91\x92\xa2mm\x05") for i, p in chain]
        keys.append(BlockKey(h(20), (20).to_bytes(4, "little") * BLOCK, seed, None))
        blocks = [torch.full(SHAPE, float(int.from_bytes(k.block_hash, "little")), dtype=LAYOUT.dtype) for k in keys]
        assert tier.put(keys, blocks) == 6
        held = list(tier.held_keys())
        assert tier.num_unannounceable == 1 and len(tier) == 6
        order = [int.from_bytes(k.block_hash, "little") for k in held]
        assert sorted(order) == [1, 2, 3, 10, 11]
        for child, parent in chain:
            if parent:
                assert order.index(parent) < order.index(child)
        by_hash = {k.block_hash: k for k in held}
        assert by_hash == {k.block_hash: k for k in keys if k.extras is not None}  # tokens, parent, extras
    finally:
        tier.close()


def test_disk_sync_accepts_modes_names_and_the_old_bool() -> None:
    assert DiskSync.parse(True) is DiskSync.COMMIT and DiskSync.parse(False) is DiskSync.NONE
    assert DiskSync.parse("group") is DiskSync.GROUP and DiskSync.parse(" Commit ") is DiskSync.COMMIT
    assert StoreConfig(LAYOUT, disk_path="/tmp/x", disk_sync=False).disk_sync is DiskSync.NONE
    assert StoreConfig(LAYOUT, disk_path="/tmp/x").disk_sync is DiskSync.COMMIT
    bad = r"StoreConfig\.disk_sync must be a bool or one of none, group, commit; got 'sometimes'"
    with pytest.raises(ConfigError, match=bad):
        StoreConfig(LAYOUT, disk_path="/tmp/x", disk_sync="sometimes")


def test_group_commit_syncs_in_the_background_and_stops_on_close(tmp_path: Path) -> None:
    tokens = _tokens(4 * BLOCK, 1)
    store = open_store(str(tmp_path), disk_sync="group")
    group = _disk(store)._writer._group
    assert group is not None and group._thread.is_alive()
    store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    deadline = time.monotonic() + 10
    while group.num_syncs == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert group.num_syncs >= 1 and group.num_failures == 0
    store.close()
    assert not group._thread.is_alive()
    assert not any(t.name == "kvstrata-disk-sync" for t in threading.enumerate())
    with open_store(str(tmp_path), disk_sync="group") as again:
        res = again.retrieve(tokens)
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)


def test_space_of_freed_slots_goes_back_to_the_file_system(tmp_path: Path) -> None:
    tokens = _tokens(64 * BLOCK, 2)
    with open_store(str(tmp_path)) as store:
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        data = next(tmp_path.glob("slots-*.kvd"))
        full = os.stat(data).st_blocks * 512
        assert full >= 64 * LAYOUT.block_bytes(BLOCK)
        store.clear()
        one = _tokens(BLOCK, 3)
        store.store(one, make_kv(one, LAYOUT, BLOCK))  # reuses one slot, gives the others back
        assert os.stat(data).st_blocks * 512 <= full // 8
        res = store.retrieve(one)
        check_kv(one, res.kv, res.num_tokens, LAYOUT, BLOCK)
        store.check_integrity()


_EVICTOR = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv, open_store
    store = open_store(sys.argv[1], namespace="evictor", disk_bytes=int(sys.argv[3]))
    rng = np.random.default_rng(5)
    deadline = time.monotonic() + float(sys.argv[4])
    while time.monotonic() < deadline:
        t = rng.integers(0, 2**32, size=8 * BLOCK, dtype=np.uint32)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
    store.close()
    """
)


@pytest.mark.slow
def test_blocks_evicted_by_another_process_while_read_are_misses_not_damage(tmp_path: Path) -> None:
    """Another process evicts this store's blocks and reuses their slots while this one reads
    them: every read returns exact bytes or stops short, and nothing is called damaged."""
    budget = 48 * bytes_per_block(LAYOUT.block_bytes(BLOCK))
    proc = subprocess.Popen([sys.executable, "-c", _EVICTOR, str(tmp_path), str(ROOT), str(budget), "4"])
    try:
        with open_store(str(tmp_path), disk_bytes=budget) as store:
            rng = np.random.default_rng(6)
            num_reads = 0
            while proc.poll() is None:
                t = rng.integers(0, 2**32, size=8 * BLOCK, dtype=np.uint32)
                store.store(t, make_kv(t, LAYOUT, BLOCK))
                for _ in range(3):
                    res = store.retrieve(t)
                    check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
                    num_reads += 1
            disk = _disk(store)
            assert disk.stats().num_corrupt == 0, f"{disk.num_raced} raced reads, some called damage"
            assert num_reads > 0
            store.check_integrity()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_a_foreign_lmdb_is_refused_before_anything_is_written_into_it(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's value")
    env.close()
    with pytest.raises(ConfigError, match="not kvstrata's"):
        open_store(str(tmp_path))
    env = lmdb.open(str(tmp_path), map_size=1 << 20)
    with env.begin() as txn:
        assert [bytes(k) for k in txn.cursor().iternext(values=False)] == [b"someone"]  # no sub-database created
    env.close()
    assert not list(tmp_path.glob("slots-*"))


def test_an_entry_damaged_into_one_without_token_ids_is_damage_not_a_miss(tmp_path: Path) -> None:
    """An entry cut right after its parent looks like one written without token ids (a sound
    miss, left in place); its payload's checksum, which binds the token ids, tells them apart:
    the damaged one is deleted. (Deciding from the entry alone left it in place for good.)"""
    tokens = _tokens(2 * BLOCK, 7)
    with open_store(str(tmp_path)) as store:
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        loc = _disk(store).payload_location(store.block_hashes(tokens)[1])
        assert loc is not None
    e = diskdamage.read_entry(tmp_path, loc.index_key)
    raw = pack_entry(e)
    diskdamage.put_entries(tmp_path, {loc.index_key: raw[: len(raw) - len(e.tokens)]})
    assert diskdamage.read_entry(tmp_path, loc.index_key).tokens == b""  # still parses
    with open_store(str(tmp_path)) as store:
        res = store.retrieve(tokens)
        assert res.num_tokens == BLOCK
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        disk = _disk(store)
        assert disk.stats().num_corrupt == 1 and disk.num_unverifiable == 0
        assert disk.match_prefix([store.block_hashes(tokens)[1]]) == 0  # deleted
        store.check_integrity()
