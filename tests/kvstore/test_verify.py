"""Verify mode's check (`KVCacheStore.verify`, `blocks.verify`): a block whose bytes are intact
(valid checksum, right token ids) but wrong (another prefix's KV stored under its key) is
caught in whichever tier holds it, removed from every tier and withdrawn by a KV event;
correct blocks are never flagged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVCacheStore, KVLayout, StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.hashing import ExtraKeys
from kvstore.metrics import register_metrics
from tests.conftest import BLOCK, LAYOUT, make_kv
from tests.mooncake_fixtures import mooncake_master
from tests.redis_fixtures import redis_server
from tiers.changes import ChangeKind
from tiers.keys import TierKind

TOKENS = list(range(6 * BLOCK))
OTHER = list(range(1000, 1000 + 6 * BLOCK))


@contextmanager
def _store(tmp_path: Path, tier: str) -> Iterator[KVCacheStore]:
    """A store whose only tier is `tier` (so the injected block lands there)."""
    bb = LAYOUT.block_bytes(BLOCK)
    tiers: dict[str, dict[str, Any]] = {
        "pool": {"type": "pool", "num_blocks": 64, "device": "cpu"},
        "cpu": {"type": "cpu", "capacity_bytes": 64 * bb},
        "disk": {"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 16 << 20, "sync": False},
    }
    if tier == "remote":
        with redis_server() as server, KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, tiers=[
                {"type": "remote", "url": server.url}])) as store:
            yield store
        return
    if tier == "mooncake":
        with mooncake_master() as master, KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, tiers=[
                master.tier()])) as store:
            yield store
        return
    tiers["sharedfs"] = {"type": "sharedfs", "path": str(tmp_path / "shared"), "capacity_bytes": 16 << 20}
    with KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, tiers=[tiers[tier]])) as store:
        yield store


@pytest.mark.parametrize("tier", ["pool", "cpu", "disk", "remote", "mooncake", "sharedfs"])
def test_another_prefixs_kv_under_a_key_is_caught_and_removed_everywhere(tmp_path: Path, tier: str) -> None:
    kv, other_kv = make_kv(len(TOKENS), seed=1), make_kv(len(OTHER), seed=2)
    with _store(tmp_path, tier) as store:
        sink: list[Any] = []
        store.changes.add_sink(sink.extend)
        keys = list(store.keys(TOKENS))
        rows = [other_kv[:, :, i * BLOCK:(i + 1) * BLOCK] for i in range(6)]
        good = [kv[:, :, i * BLOCK:(i + 1) * BLOCK] for i in range(6)]
        # blocks 0-2 right, block 3 wrong but intact (its own key and token ids, another prefix's KV), 4-5 right
        store.blocks.save(keys, [good[0], good[1], good[2], rows[3], good[4], good[5]])
        store.flush()
        assert store.lookup(TOKENS) == len(TOKENS)  # checksums and token ids cannot see it
        result = store.verify(TOKENS, kv)
        assert result.mismatches == {TierKind(tier): [3]} and result.num_quarantined == 1
        assert result.num_checked == 6 and not result.ok
        assert store.lookup(TOKENS) == 3 * BLOCK  # gone: the prefix ends before it
        got = store.retrieve(TOKENS)
        assert got.kv is not None and got.kv.equal(kv[:, :, : 3 * BLOCK])
        left = [k.block_hash for c in sink if c.kind is ChangeKind.LEFT for k in c.keys]
        assert keys[3].block_hash in left  # withdrawn from routers
        stats = store.stats()
        assert stats.verify_mismatches == {TierKind(tier): 1} and stats.num_verified_blocks == 6


def test_correct_blocks_are_never_flagged_and_nothing_is_stored(tmp_path: Path) -> None:
    bb = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=4 * bb, disk_path=str(tmp_path / "d"), disk_bytes=16 << 20,
                      disk_sync=False)
    with KVCacheStore(cfg) as store:
        salt = ExtraKeys(cache_salt="tenant-a")
        for seed in range(20):
            tokens = [seed * 1000 + t for t in range(8 * BLOCK)]
            kv = make_kv(len(tokens), seed=seed)
            store.store(tokens, kv, extra_keys=salt)
            result = store.verify(tokens, kv, extra_keys=salt)
            assert result.ok and result.num_quarantined == 0 and result.num_checked >= 8
        assert store.verify(list(range(9000, 9000 + 4 * BLOCK)), make_kv(4 * BLOCK)).num_checked == 0  # not held
        assert store.lookup(list(range(9000, 9000 + 4 * BLOCK))) == 0  # verify stored nothing
        assert store.stats().verify_mismatches == {}


def test_a_block_wrong_in_one_tier_is_removed_from_the_tier_that_was_right_too(tmp_path: Path) -> None:
    bb = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=16 * bb, disk_path=str(tmp_path / "d"), disk_bytes=16 << 20,
                      disk_sync=False, write_through=True)
    with KVCacheStore(cfg) as store:
        kv = make_kv(len(TOKENS), seed=1)
        store.store(TOKENS, kv)  # CPU and disk both hold every block, right
        keys = list(store.keys(TOKENS))
        disk = next(t for t in store.tiers if t.kind is TierKind.DISK)
        disk.discard([keys[2].block_hash])
        disk.put([keys[2]], [make_kv(BLOCK, seed=9)])  # the disk's copy: intact, wrong
        result = store.verify(TOKENS, kv)
        assert result.mismatches == {TierKind.DISK: [2]}
        assert store.lookup(TOKENS) == 2 * BLOCK  # removed from the CPU tier as well
        assert not torch.equal(make_kv(BLOCK, seed=9), kv[:, :, 2 * BLOCK:3 * BLOCK])


@pytest.mark.parametrize("codec", ["int8", "fp8", "k8v4"])
def test_a_lossy_tier_is_compared_within_its_codecs_bound(tmp_path: Path, codec: str) -> None:
    """A lossy tier's decoded copies of correct blocks stay within the codec's error bound
    (no false alarm, over many prompts), and another prefix's KV under a key is far outside
    it (caught); each check reports the bound and the largest error it saw."""
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, disk_path=str(tmp_path / "d"), disk_bytes=64 << 20,
                      disk_sync=False, disk_codec=codec)
    with KVCacheStore(cfg) as store:
        for seed in range(12):
            tokens = [100_000 + seed * 1000 + t for t in range(6 * BLOCK)]
            kv = make_kv(len(tokens), seed=seed)
            store.store(tokens, kv)
            result = store.verify(tokens, kv)
            check = result.tiers[TierKind.DISK]
            assert result.ok and result.num_checked == 6 and result.num_unverified == 0
            assert 0 < check.max_error <= check.bound  # lossy, within its bound
        keys = list(store.keys(TOKENS))
        kv, other_kv = make_kv(len(TOKENS), seed=1), make_kv(len(OTHER), seed=2)
        rows = [kv[:, :, i * BLOCK:(i + 1) * BLOCK] for i in range(6)]
        rows[4] = other_kv[:, :, 4 * BLOCK:5 * BLOCK]
        store.blocks.save(keys, rows)
        result = store.verify(TOKENS, kv)
        check = result.tiers[TierKind.DISK]
        # The bound covers any number of round trips (2-3 one-trip bounds): still far inside.
        assert result.mismatches == {TierKind.DISK: [4]} and check.max_error > 4 * check.bound
        assert store.lookup(TOKENS) == 4 * BLOCK
        stats = store.stats()
        assert stats.verify_mismatches == {TierKind.DISK: 1}
        assert stats.verify_bound[TierKind.DISK] > 0 and stats.verify_max_error[TierKind.DISK] > 4 * check.bound
        registry = pytest.importorskip("prometheus_client").CollectorRegistry()
        name = register_metrics(store, registry)
        [labels] = [dict(m.samples[0].labels) for m in registry.collect() if m.name == "kvstrata_verify_bound"]
        assert labels["tier"] == "disk" and labels["store"] == name
        got = {m: registry.get_sample_value(m, labels) for m in
               ("kvstrata_verify_mismatch_total", "kvstrata_verify_bound", "kvstrata_verify_max_error")}
        assert got["kvstrata_verify_mismatch_total"] == 1 and got["kvstrata_verify_bound"] == stats.verify_bound[
            TierKind.DISK] and got["kvstrata_verify_max_error"] == stats.verify_max_error[TierKind.DISK]


def test_a_block_promoted_from_a_lossy_tier_is_no_false_alarm_in_an_exact_one(tmp_path: Path) -> None:
    """A disk hit in int8 promoted into the CPU tier puts decoded (lossy) values in an exact
    tier: they are held to the codec's bound there too, not byte for byte (a false alarm
    would remove a right block)."""
    bb = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=8 * bb, disk_path=str(tmp_path / "d"), disk_bytes=16 << 20,
                      disk_sync=False, disk_codec="int8", write_through=True)
    with KVCacheStore(cfg) as store:
        kv = make_kv(len(TOKENS), seed=5)
        store.store(TOKENS, kv)
        for seed in range(3):  # evict TOKENS' blocks from the CPU tier
            store.store([50_000 + seed * 1000 + t for t in range(6 * BLOCK)], make_kv(6 * BLOCK, seed=10 + seed))
        got = store.retrieve(TOKENS)  # from disk, promoted into the CPU tier
        assert got.num_tokens == len(TOKENS)
        assert TierKind.CPU in set(store.locate(TOKENS))
        result = store.verify(TOKENS, kv)
        assert result.ok and result.tiers[TierKind.CPU].num_checked > 0 and result.tiers[TierKind.CPU].bound > 0
        assert store.lookup(TOKENS) == len(TOKENS)


BF16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.mark.parametrize("codec", ["int8", "fp8", "k8v4"])
def test_a_block_encoded_again_and_again_is_no_false_alarm_and_a_wrong_one_is_caught(tmp_path: Path,
                                                                                     codec: str) -> None:
    """Six times over: a disk hit promoted into the CPU tier (decoded values), the disk's own
    copy evicted, then the CPU tier evicting the block demotes its decoded values to disk (a
    second encode, a third...). Verify against the KV computed once finds every copy within
    the bound (`reencoded_error_bound`; before: int8 reached 2.1x the one-round-trip bound in
    bfloat16, FP8 and K8V4 grew without end); another prefix's KV is still caught."""
    block, tokens = 16, list(range(4 * 16))
    bb = BF16.block_bytes(block)
    cfg = StoreConfig(BF16, block_size=block, cpu_bytes=8 * bb, disk_path=str(tmp_path / "d"), disk_bytes=64 << 20,
                      disk_sync=False, disk_codec=codec, write_through=True)
    with KVCacheStore(cfg) as store:
        kv = make_kv(len(tokens), seed=5, layout=BF16)
        kv[:, 0, :, :, [3, 40]] *= 10  # outlier key channels, as real keys have
        store.store(tokens, kv)
        hashes = [k.block_hash for k in store.keys(tokens)]
        cpu, disk = (next(t for t in store.tiers if t.kind is kind) for kind in (TierKind.CPU, TierKind.DISK))
        for cycle in range(6):
            for seed in range(3):  # evict the blocks from the CPU tier (into the disk tier where it lacks them)
                filler = [100_000 * (cycle + 1) + seed * 1000 + t for t in range(4 * block)]
                store.store(filler, make_kv(len(filler), seed=10 + seed, layout=BF16))
            assert cpu.match_prefix(hashes) == 0 and disk.match_prefix(hashes) == len(hashes)
            assert store.retrieve(tokens).num_tokens == len(tokens)  # from disk, promoted: decoded values
            assert cpu.match_prefix(hashes) == len(hashes)
            assert disk.discard(hashes) == len(hashes)  # the disk evicts its copy; the next eviction re-encodes
        result = store.verify(tokens, kv)
        assert result.ok, {k: (c.max_error, c.bound) for k, c in result.tiers.items()}
        assert result.tiers[TierKind.CPU].num_checked == len(hashes)
        wrong = make_kv(len(tokens), seed=2, layout=BF16)[:, :, 2 * block:3 * block]
        cpu.discard([hashes[2]])
        cpu.put([list(store.keys(tokens))[2]], [wrong])
        assert store.verify(tokens, kv).mismatches == {TierKind.CPU: [2]}
        assert store.lookup(tokens) == 2 * block


def test_a_tolerance_admits_batch_variant_numerics_and_still_catches_a_wrong_block(tmp_path: Path) -> None:
    """An exact store compares byte for byte; `tolerance` admits small differences (engines
    whose numerics vary with batch shape) yet another prefix's KV stays far outside it."""
    bb = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * bb)
    with KVCacheStore(cfg) as store:
        kv = make_kv(len(TOKENS), seed=1)
        store.store(TOKENS, kv)
        again = (kv.float() * 1.02).to(kv.dtype)  # the same prefix computed in another batch shape
        result = store.verify(TOKENS, again, tolerance=0.05)
        check = result.tiers[TierKind.CPU]
        assert result.ok and 0 < check.max_error <= check.bound
        keys = list(store.keys(TOKENS))
        wrong = make_kv(len(OTHER), seed=2)[:, :, 2 * BLOCK:3 * BLOCK]
        cpu = next(t for t in store.tiers if t.kind is TierKind.CPU)
        cpu.discard([keys[2].block_hash])
        cpu.put([keys[2]], [wrong])
        result = store.verify(TOKENS, again, tolerance=0.05)
        assert result.mismatches == {TierKind.CPU: [2]}
        assert store.verify(TOKENS, again).mismatches == {TierKind.CPU: [0, 1, 3, 4, 5]}  # exact: every block differs
        assert store.lookup(TOKENS) == 0


@pytest.mark.parametrize("bad", [float("nan"), -0.1, 1.5, float("inf"), "0.1", True, None])
def test_a_bad_tolerance_is_one_clear_error_and_changes_nothing(tmp_path: Path, bad: object) -> None:
    bb = LAYOUT.block_bytes(BLOCK)
    with KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * bb)) as store:
        kv = make_kv(len(TOKENS), seed=1)
        store.store(TOKENS, kv)
        with pytest.raises(InvalidInputError, match="verify tolerance must be a number in \\[0, 1\\]"):
            store.verify(TOKENS, make_kv(len(TOKENS), seed=2), tolerance=bad)  # type: ignore[arg-type]
        assert store.lookup(TOKENS) == len(TOKENS) and store.stats().num_verified_blocks == 0


def test_the_warning_names_namespace_tier_block_error_and_bound(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from tiers.shared import ratelimit

    bb = LAYOUT.block_bytes(BLOCK)
    with KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * bb, namespace="ns-warn")) as store:
        kv = make_kv(len(TOKENS), seed=1)
        keys = list(store.keys(TOKENS))
        store.blocks.save(keys[:3], [kv[:, :, i * BLOCK:(i + 1) * BLOCK] for i in range(2)]
                          + [make_kv(BLOCK, seed=7)])
        import kvstore.verify as verify_module
        verify_module._warn = ratelimit.RateLimitedWarning(verify_module.logger)  # a fresh limit
        with caplog.at_level("WARNING", logger="kvstore.verify"):
            assert store.verify(TOKENS[:3 * BLOCK], kv[:, :, :3 * BLOCK]).mismatches == {TierKind.CPU: [2]}
        [line] = [r.getMessage() for r in caplog.records if r.name == "kvstore.verify"]
        assert "'ns-warn'" in line and "cpu: 1 block(s), first block 2" in line
        assert "max error" in line and "bound of 0" in line


def test_the_comparison_sees_nan_patterns_and_a_nan_is_never_within_a_bound() -> None:
    from kvstore.verify import Computed, VerifyBound, compare, same_bytes

    x = torch.randn(2, 2, BLOCK, 2, 8)
    y = x.clone()
    y.view(-1)[5] = float("nan")
    z = y.clone()
    z.view(torch.int32).view(-1)[5] ^= 1  # another NaN: other bytes
    assert same_bytes(y, y.clone()) and not same_bytes(y, z) and not same_bytes(x, y)
    assert not same_bytes(x, x.view(torch.uint8)[..., :-4])  # other sizes
    loose = VerifyBound(tolerance=1.0)
    assert compare(x, Computed(x, loose))[:2] == (True, 0.0)
    within, err, allowed = compare(y, Computed(x, loose))  # a NaN held where a number was computed
    assert not within and err == float("inf") and allowed > 0
    assert compare(y, Computed(y.clone(), loose))[0]  # not finite: byte for byte, and the same bytes


def test_reads_in_batches_skip_a_missing_or_damaged_block_and_check_the_rest(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify reads a tier in calls of several blocks; a block the tier lacks (2) or finds
    damaged (0: its payload overwritten on disk; the tier deletes it) is skipped, and the
    blocks after it, in the same call or later ones, are still compared: the wrong one (4)
    is caught."""
    import kvstore.verify as verify_module

    bb = LAYOUT.block_bytes(BLOCK)
    monkeypatch.setattr(verify_module, "READ_BYTES", 2 * bb)  # calls of two blocks
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=16 * bb, disk_path=str(tmp_path / "d"), disk_bytes=16 << 20,
                      disk_sync=False, write_through=True)
    with KVCacheStore(cfg) as store:
        kv = make_kv(len(TOKENS), seed=1)
        store.store(TOKENS, kv)
        store.flush()
        keys = list(store.keys(TOKENS))
        disk = next(t for t in store.tiers if t.kind is TierKind.DISK)
        disk.discard([keys[2].block_hash, keys[4].block_hash])
        disk.put([keys[4]], [make_kv(BLOCK, seed=9)])  # intact, wrong
        store.flush()
        where = disk.payload_location(keys[0].block_hash)  # type: ignore[attr-defined]
        with open(where.file, "r+b") as f:
            f.seek(where.offset + where.length // 2)
            f.write(b"\xff" * 64)
        result = store.verify(TOKENS, kv)
        assert result.mismatches == {TierKind.DISK: [4]}
        assert result.tiers[TierKind.CPU].num_checked == 6 and result.tiers[TierKind.DISK].num_checked == 4
        assert disk.match_prefix([keys[0].block_hash]) == 0 and disk.counters.num_corrupt == 1  # deleted
        assert store.stats().verify_mismatches == {TierKind.DISK: 1}
