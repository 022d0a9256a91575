"""The shared-filesystem tier in one process, on real files: its config, damaged records
(flipped, truncated, lengthened) as counted misses that end a prefix, LRU by mtime with a read
as a use, orphaned temporary files, files kvstrata did not write (never removed), a directory
gone or hung (a FIFO where a block should be: a read that never returns) as bounded, counted
misses, and its config through the vLLM connector's `tiers`."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import ConfigError, KVCacheStore, StoreConfig
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.shared_tiers import shared_stored_events
from tests.tiers.sharedfs_host import open_store, shared_tier, tokens
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.sharedfs import files
from tiers.sharedfs.config import SharedFSTierConfig
from tiers.sharedfs.space import Space
from tiers.sharedfs.tier import SharedFSTier
from tiers.tier_config import TierContext, tier_config

SHAPE = LAYOUT.block_shape(BLOCK)
NS = BlockHash(b"n" * 16)


def key(i: int) -> BlockKey:
    return BlockKey(BlockHash(i.to_bytes(16, "little")), i.to_bytes(4, "little") * BLOCK)


def block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(LAYOUT.dtype)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[SharedFSTier]:
    t = _open(tmp_path / "shared")
    yield t
    t.close()


def _open(root: Path, **fields: Any) -> SharedFSTier:
    t = SharedFSTierConfig(str(root), **fields).open(TierContext(SHAPE, LAYOUT.dtype, NS))
    assert isinstance(t, SharedFSTier)
    return t


def _path(t: SharedFSTier, i: int) -> Path:
    return Path(files.block_path(t.ns_dir, key(i).block_hash))


def _get(t: SharedFSTier, ids: list[int]) -> tuple[int, list[torch.Tensor]]:
    dsts = [torch.zeros(SHAPE, dtype=LAYOUT.dtype) for _ in ids]
    return t.get_into([key(i) for i in ids], dsts), dsts


@pytest.mark.parametrize(("field", "value"), [
    ("path", ""), ("capacity_bytes", 0), ("io_threads", 0), ("timeout_s", 0), ("timeout_s", float("nan")),
    ("orphan_after_s", -1), ("scan_max_entries", True), ("share_id", ""), ("codec", "nope")])
def test_a_bad_config_value_is_one_error_naming_it(tmp_path: Path, field: str, value: object) -> None:
    fields = {"path": str(tmp_path), field: value}
    with pytest.raises(ConfigError, match=field):
        SharedFSTierConfig(**fields)  # type: ignore[arg-type]


def test_from_a_dict_and_through_the_vllm_connectors_tiers(tmp_path: Path) -> None:
    config = tier_config({"type": "sharedfs", "path": str(tmp_path), "capacity_bytes": 1 << 30, "io_threads": 4})
    assert isinstance(config, SharedFSTierConfig) and config.io_threads == 4
    from tests.engine_adapter.vllm.test_settings import CPU, store_of

    tiers = store_of({"tiers": [CPU, {"type": "sharedfs", "path": str(tmp_path / "kv"), "timeout_s": 2}]}).tier_configs
    assert isinstance(tiers[-1], SharedFSTierConfig) and tiers[-1].timeout_s == 2.0


def test_a_directory_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"SharedFSTierConfig\.path"):
        _open(tmp_path / "file" / "below")


def test_files_are_named_by_key_in_two_levels_of_shards(tier: SharedFSTier) -> None:
    assert tier.put([key(0x0102)], [block(1)]) == 1
    h = key(0x0102).block_hash.hex()
    assert _path(tier, 0x0102) == Path(tier.ns_dir) / h[:2] / h[2:4] / f"{h}.kvb"
    assert _path(tier, 0x0102).is_file()
    assert tier.put([key(0x0102)], [block(1)]) == 0, "a block already there is not written again"


@pytest.mark.parametrize("damage", ["flip", "truncate", "lengthen", "empty", "too long"])
def test_a_damaged_file_is_a_counted_miss_that_ends_the_prefix_and_is_removed(tier: SharedFSTier,
                                                                              damage: str) -> None:
    assert tier.put([key(i) for i in (3, 2, 1, 0)], [block(i) for i in (3, 2, 1, 0)]) == 4
    path = _path(tier, 2)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "lengthen":
        data += b"\0" * 100
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"\0" * (1 << 17)  # past any record of this layout: refused unread
    path.write_bytes(data)
    n, dsts = _get(tier, [0, 1, 2, 3])
    assert n == 2, "the prefix stops at the damaged block: no hole"
    assert all(torch.equal(d.view(torch.int16), block(i).view(torch.int16)) for i, d in zip([0, 1], dsts))
    assert torch.count_nonzero(dsts[3].view(torch.int16)) == 0, "nothing written past the miss"
    assert tier.counters.num_corrupt == 1 and not path.exists()
    assert tier.match_prefix([key(i).block_hash for i in range(4)]) == 2


def test_a_record_of_other_tokens_is_a_miss(tier: SharedFSTier) -> None:
    tier.put([key(0)], [block(0)])
    other = BlockKey(key(0).block_hash, b"\1" * (4 * BLOCK))
    assert tier.get_into([other], [torch.empty(SHAPE, dtype=LAYOUT.dtype)]) == 0
    assert tier.counters.num_corrupt == 1


def test_eviction_takes_the_least_recently_used_file_by_mtime_and_a_read_is_a_use(tmp_path: Path) -> None:
    record = _path_size(tmp_path)
    t = _open(tmp_path / "shared", capacity_bytes=6 * record, touch_after_s=0.0)
    try:
        t.put([key(i) for i in range(5, -1, -1)], [block(i) for i in range(5, -1, -1)])  # 0 first written
        for i in range(6):
            os.utime(_path(t, i), (1000 + i, 1000 + i))  # 0 is the oldest, 5 the newest
        assert _get(t, [0])[0] == 1  # a read: 0 is now the most recently used
        t.space.scan()
        t.put([key(6), key(7)], [block(6), block(7)])  # over capacity: evicts 1, 2 (down to 15/16)
        held = {i for i in range(8) if t.match_prefix([key(i).block_hash])}
        assert {0, 6, 7} <= held and 1 not in held and 2 not in held, held
        assert t.counters.num_evictions >= 2
    finally:
        t.close()


def _path_size(tmp_path: Path) -> int:
    t = _open(tmp_path / "probe")
    try:
        t.put([key(0)], [block(0)])
        return _path(t, 0).stat().st_size
    finally:
        t.close()


def _foreign(t: SharedFSTier) -> list[Path]:
    h = key(1).block_hash.hex()
    leaf = Path(t.ns_dir) / h[:2] / h[2:4]
    leaf.mkdir(parents=True, exist_ok=True)
    paths = [Path(t.root) / "mine.kvb", Path(t.ns_dir) / "notes",
             leaf / "00112233.kvb",  # a block's name in the wrong shard
             leaf / f".{h}.host.1.0123456789abcdef.tmpx", leaf / f"{h}.kvb.bak"]
    for p in paths:
        p.write_bytes(b"foreign")
        os.utime(p, (1, 1))
    return paths


def test_clear_orphan_cleanup_and_eviction_never_remove_a_foreign_file(tmp_path: Path) -> None:
    t = _open(tmp_path / "shared", capacity_bytes=4 * _path_size(tmp_path), orphan_after_s=0.01)
    try:
        foreign = _foreign(t)
        h = key(9).block_hash.hex()
        leaf = Path(t.ns_dir) / h[:2] / h[2:4]
        leaf.mkdir(parents=True, exist_ok=True)
        orphan = leaf / files.temp_name(key(9).block_hash)
        orphan.write_bytes(b"half a block")
        os.utime(orphan, (1, 1))
        for i in range(10):
            t.put([key(i + 20)], [block(i)])
        t.space.scan()
        assert not orphan.exists() and t.space.num_orphans_removed == 1
        assert t.counters.num_evictions > 0
        assert t.sweep(all_namespaces=True).complete
        assert t.match_prefix([key(20 + i).block_hash for i in range(10)]) == 0
        assert all(p.exists() for p in foreign), [p for p in foreign if not p.exists()]
    finally:
        t.close()


def test_a_directory_gone_is_a_counted_miss_and_drop_never_an_exception(tmp_path: Path) -> None:
    t = _open(tmp_path / "shared")
    try:
        t.put([key(0)], [block(0)])
        shutil.rmtree(t.root)
        Path(t.root).write_bytes(b"a file where the directory was")  # ENOTDIR below it
        assert t.put([key(1)], [block(1)]) == 0
        assert t.num_write_drops == 1 and t.num_errors >= 1
        assert _get(t, [0])[0] == 0 and t.match_prefix([key(0).block_hash]) == 0
        assert t.sweep().complete is False
        assert list(t.held_hashes()) == []
    finally:
        t.close()


def test_a_read_that_hangs_is_a_bounded_counted_miss(tmp_path: Path) -> None:
    """A FIFO where a block's file should be: opening it blocks until a writer comes, as a
    read of a hung NFS mount does. The call returns within its timeout, counts a fault and
    pauses the tier; the stuck thread is released at the end."""
    t = _open(tmp_path / "shared", timeout_s=2, cooldown_s=60)
    fifo = _path(t, 1)
    try:
        t.put([key(0)], [block(0)])
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo)
        started = time.monotonic()
        n, _ = _get(t, [0, 1])
        assert n == 1 and time.monotonic() - started < 15
        assert t.num_timeouts == 1 and t.num_errors == 1
        assert _get(t, [0])[0] == 0, "paused after a call ran out of time: a miss at once"
        assert t.put([key(2)], [block(2)]) == 0 and t.num_write_drops == 1
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # releases the blocked reader
        os.close(fd)
        t.close()


def test_two_stores_share_blocks_and_a_clear_is_seen_by_both(tmp_path: Path) -> None:
    root = str(tmp_path / "shared")
    a, b = open_store(root), open_store(root, local=False)
    try:
        t = tokens(5)
        a.store(t, make_kv(t, LAYOUT, BLOCK))
        res = b.retrieve(t)
        assert check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK) == 4
        assert res.blocks_per_tier == {TierKind("sharedfs"): 4}
        b.clear()
        assert a.lookup(t) == 4 * BLOCK  # a's own memory tiers still hold it
        assert shared_tier(a).match_prefix([k.block_hash for k in a.keys(t)]) == 0, "b's clear: gone for a too"
    finally:
        a.close()
        b.close()


def test_parallel_puts_from_threads_of_one_store(tmp_path: Path) -> None:
    store: KVCacheStore = KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, tiers=[
        {"type": "cpu", "capacity_bytes": 4 * LAYOUT.block_bytes(BLOCK)},
        {"type": "sharedfs", "path": str(tmp_path / "shared"), "io_threads": 4}]))
    prompts = [tokens(100 + i, blocks=8) for i in range(4)]

    def put(t: Any) -> None:
        store.store(t, make_kv(t, LAYOUT, BLOCK))

    threads = [threading.Thread(target=put, args=(t,)) for t in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    try:
        for t in prompts:
            res = store.retrieve(t)
            assert check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK) == 8
    finally:
        store.close()


@pytest.mark.parametrize("verify", [True, False])
def test_a_record_written_from_the_blocks_own_memory_is_the_encoded_record(verify: bool) -> None:
    """`encode_parts` (no copy of the payload) seals the very bytes `encode` does; a strided
    block or another device goes through `encode`."""
    from tiers.shared.record import RecordCodec

    codec = RecordCodec(SHAPE, LAYOUT.dtype, verify_tokens=verify, namespace=NS)
    k = key(5)._replace(parent=b"p" * 16, extras=b"")
    parts = codec.encode_parts(k, block(5))
    assert parts is not None and b"".join(bytes(p) for p in parts) == bytes(codec.encode(k, block(5)))
    wide = torch.zeros(LAYOUT.block_shape(2 * BLOCK), dtype=LAYOUT.dtype)
    assert codec.encode_parts(k, wide[:, :, :BLOCK]) is None


def test_a_block_changed_while_it_is_written_is_a_miss_never_other_bytes(tier: SharedFSTier) -> None:
    """The checksum is taken before the block's own memory is written out: bytes changed in
    between (a caller reusing its buffer after a timed-out put) make a record that fails."""
    src = block(3)
    parts = tier.codec.encode_parts(key(3), src)
    assert parts is not None
    src.view(torch.int16)[0, 0, 0, 0, 0] += 1  # changed after sealing, before the write
    from tiers.sharedfs import blockio

    blockio.write_file(tier.ns_dir, key(3).block_hash, parts)
    assert _get(tier, [3])[0] == 0 and tier.counters.num_corrupt == 1


def test_events_announce_its_blocks_as_shared_naming_the_directory(tmp_path: Path) -> None:
    """As the remote tier's: the shared trait makes its blocks SHARED for routers (every host
    reads them), and the source names the directory, so routers tell which instances share it."""
    from cli.ports import free_port_pair
    from tests.kvstore.test_events import Reader

    port = free_port_pair()
    config = StoreConfig(LAYOUT, block_size=BLOCK, namespace="sharedfs-events", events_endpoint=f"tcp://127.0.0.1:{port}",
                         tiers=[{"type": "cpu", "capacity_bytes": 16 * LAYOUT.block_bytes(BLOCK)},
                                {"type": "sharedfs", "path": str(tmp_path / "shared"), "capacity_bytes": 64 << 20}])
    with KVCacheStore(config) as store:
        reader = Reader(port)
        try:
            reader.welcomed()
            stored = shared_stored_events(store, reader, tokens(3, 6))
            assert all(e["kvstrata"]["remote"].startswith("sharedfs:") for e in stored)
            assert all(str((tmp_path / "shared").resolve()) in e["kvstrata"]["remote"] for e in stored)
        finally:
            reader.close()


def test_a_discard_is_not_undone_by_a_write_still_running(tmp_path: Path) -> None:
    """A write held past its put's timeout (as on a hung mount; the real write runs once let
    go) is still running when verify's quarantine discards its block: when it ends, the file
    it put in place is removed again; a write of the same block later stays."""
    t = _open(tmp_path / "shared", timeout_s=0.3, cooldown_s=0.01)
    let_go, ended = threading.Event(), threading.Event()
    write = t._write

    def held_write(k: BlockKey, parts: Any) -> bool:
        assert let_go.wait(30)
        try:
            return write(k, parts)
        finally:
            ended.set()

    t._write = held_write  # type: ignore[method-assign]
    try:
        assert t.put([key(1)], [block(1)]) == 0 and t.num_timeouts == 1  # the put gave up; the write runs on
        assert t.discard([key(1).block_hash]) == 0  # not there yet
        let_go.set()
        assert ended.wait(30)
        deadline = time.monotonic() + 30
        while _path(t, 1).exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the write's thread removes it right after the write
        assert not _path(t, 1).exists() and t.match_prefix([key(1).block_hash]) == 0
        t._write = write  # type: ignore[method-assign]
        time.sleep(0.05)  # the pause after the timeout is over
        assert t.put([key(1)], [block(1)]) == 1 and _path(t, 1).exists()
        assert len(t._in_flight) == 0
    finally:
        let_go.set()
        t.close()


@pytest.mark.parametrize("call", ["maintain", "scan"])
def test_a_forced_round_or_a_scan_waits_for_the_round_running_and_sees_the_directory_under_capacity(
        tmp_path: Path, call: str) -> None:
    """A forced round or a scan asked while another thread is evicting waits for it: after
    it the directory and the estimate are under capacity. Before, a forced round returned at
    once and a scan ran beside the eviction (racing its counts), both leaving it over."""
    ns_dir = tmp_path / files.namespace_dir_name(bytes(NS))
    for i in range(40):
        h = BlockHash(bytes([i]) * 16)
        path = Path(files.block_path(str(ns_dir), h))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    evicting, removed = threading.Event(), []

    def slow_removal(entry: files.Entry) -> None:
        removed.append(entry.path)
        evicting.set()
        time.sleep(0.02)

    space = Space(str(tmp_path), 10_000, scan_interval_s=60.0, scan_max_entries=100_000, orphan_after_s=60.0,
                  on_removed=slow_removal, on_fault=lambda what, exc: pytest.fail(f"{what}: {exc}"))
    first = threading.Thread(target=space.maintain, kwargs={"force_scan": True})
    first.start()
    assert evicting.wait(10)
    if call == "maintain":
        space.maintain(force_scan=True)
    else:
        space.scan()
    assert space.used_bytes() <= space.capacity_bytes, space.used_bytes()
    on_disk = sum(p.stat().st_size for p in ns_dir.rglob("*.kvb"))
    assert on_disk <= space.capacity_bytes, on_disk
    first.join(10)
    assert len(removed) == len(set(removed)) >= 30


def test_a_clear_while_a_maintenance_round_runs_finishes_and_leaves_the_tier_working(tmp_path: Path) -> None:
    """A clear whose files are gone does not wait out its deadline for a maintenance round
    another thread runs (a slow directory's eviction): before, its closing scan waited for
    the round, so the finished clear was reported incomplete with 0 files, counted as a
    timeout, and paused the whole tier for `cooldown_s` (every call a miss)."""
    t = _open(tmp_path / "s", timeout_s=1.0, clear_budget_s=1.0, cooldown_s=600.0)
    try:
        assert t.put([key(i) for i in range(3)], [block(i) for i in range(3)]) == 3
        t.space._busy.acquire()  # a maintenance round running, held here
        try:
            swept = t.sweep()
        finally:
            t.space._busy.release()
        assert (swept.complete, swept.num_deleted, t.num_timeouts) == (True, 3, 0)
        assert not _path(t, 0).exists()
        assert t.space.scan_due()  # the estimate is refreshed by the next round instead
        assert t.put([key(5)], [block(5)]) == 1 and _get(t, [5])[0] == 1  # not paused
    finally:
        t.close()
