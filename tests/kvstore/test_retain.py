"""Retention (`KVCacheStore.retain`, `blocks.retain`): a prefix a caller says will come back
stays in the CPU tier through a flood that evicts everything else, until its deadline, within
a per-tenant budget; the rest is reported clipped; bad input is one clear error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError, InvalidInputError
from kvstore.hashing import ExtraKeys
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.keys import TierKind

CPU_BLOCKS = 32


def _store(tmp_path: Path, **kw: object) -> KVCacheStore:
    return KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=CPU_BLOCKS * LAYOUT.block_bytes(BLOCK),
                                    disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, disk_sync=False, **kw))


def _flood(store: KVCacheStore, n: int, salt: ExtraKeys | None = None) -> None:
    for i in range(n):
        tokens = [100_000 + i * 1000 + t for t in range(8 * BLOCK)]
        store.store(tokens, make_kv(len(tokens), seed=i), extra_keys=salt)


def test_a_retained_prefix_survives_a_flood_in_the_cpu_tier_and_leaves_after_its_deadline(tmp_path: Path) -> None:
    session = list(range(8 * BLOCK))
    with _store(tmp_path) as store:
        store.store(session, make_kv(len(session)))
        assert store.retain(session, 0.6) == (8, 0)
        _flood(store, 20)  # 160 blocks through a 32-block CPU tier
        assert store.locate(session) == [TierKind.CPU] * 8  # still in memory
        time.sleep(0.7)
        _flood(store, 20)  # the deadline passed: the next writes release it, the flood evicts it
        assert TierKind.CPU not in store.locate(session)
        store.check_integrity()


def test_without_retain_the_same_flood_sends_the_prefix_down(tmp_path: Path) -> None:
    session = list(range(8 * BLOCK))
    with _store(tmp_path) as store:
        store.store(session, make_kv(len(session)))
        _flood(store, 20)
        assert TierKind.CPU not in store.locate(session)  # the control: the test above can fail


def test_one_tenant_cannot_pin_more_than_its_share_and_the_rest_is_clipped(tmp_path: Path) -> None:
    a, b = ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")
    with _store(tmp_path, retain_share=0.25) as store:  # 8 of 32 blocks per tenant
        long = list(range(12 * BLOCK))
        store.store(long, make_kv(len(long)), extra_keys=a)
        assert store.retain(long, 60, extra_keys=a) == (8, 4)
        other = list(range(5000, 5000 + 4 * BLOCK))
        store.store(other, make_kv(len(other)), extra_keys=b)
        assert store.retain(other, 60, extra_keys=b) == (4, 0)  # another tenant's budget is its own
        assert store.retain(long[: 4 * BLOCK], 120, extra_keys=a) == (4, 0)  # extending charges nothing
        _flood(store, 20)
        assert store.locate(long, extra_keys=a)[:8] == [TierKind.CPU] * 8
        assert store.retain(list(range(9000, 9000 + 2 * BLOCK)), 5).num_clipped == 2  # not cached: clipped
        store.check_integrity()


def test_all_tenants_together_keep_a_quarter_of_the_tier_free(tmp_path: Path) -> None:
    with _store(tmp_path, retain_share=1.0) as store:  # each tenant alone could take it all
        for i, salt in enumerate(("a", "b", "c")):
            tokens = list(range(i * 1000, i * 1000 + 12 * BLOCK))
            store.store(tokens, make_kv(len(tokens)), extra_keys=ExtraKeys(cache_salt=salt))
            store.retain(tokens, 60, extra_keys=ExtraKeys(cache_salt=salt))
        assert len(store.blocks.retention) == CPU_BLOCKS * 3 // 4  # type: ignore[attr-defined]
        _flood(store, 4)
        assert store.locate(list(range(103_000, 103_000 + 8 * BLOCK)))[0] is TierKind.CPU  # room for the rest
        store.check_integrity()


def test_clear_forgets_retention_and_a_prefix_stored_again_can_be_retained(tmp_path: Path) -> None:
    session = list(range(8 * BLOCK))
    with _store(tmp_path) as store:
        store.store(session, make_kv(len(session)))
        store.retain(session, 60)
        store.clear()
        store.store(session, make_kv(len(session)))
        assert store.retain(session, 60) == (8, 0)
        _flood(store, 10)
        store.check_integrity()


def test_a_retained_block_found_wrong_by_verify_is_removed_all_the_same(tmp_path: Path) -> None:
    session = list(range(4 * BLOCK))
    with _store(tmp_path) as store:
        keys = list(store.keys(session))
        good = make_kv(len(session), seed=1)
        wrong = make_kv(BLOCK, seed=7)
        store.blocks.save(keys, [good[:, :, i * BLOCK:(i + 1) * BLOCK] if i != 2 else wrong for i in range(4)])
        store.retain(session, 60)
        result = store.verify(session, good)
        assert result.mismatches == {TierKind.CPU: [2]}
        assert store.lookup(session) == 2 * BLOCK
        store.check_integrity()


def test_retaining_a_hot_prefix_again_and_again_keeps_bounded_state(tmp_path: Path) -> None:
    """Every retain of a prefix already retained extends its deadline; the deadlines kept
    stay bounded by the blocks retained, not by the calls (a shared prompt retained by each
    request), and the latest deadline is the one that counts."""
    session = list(range(8 * BLOCK))
    with _store(tmp_path) as store:
        store.store(session, make_kv(len(session)))
        for _ in range(2000):
            assert store.retain(session, 600) == (8, 0)
        assert store.blocks.retention.num_deadlines <= 2 * 8 + 64  # type: ignore[attr-defined]
        assert store.retain(session, 0.3) == (8, 0)  # shorter: the 600 s deadline stays
        time.sleep(0.4)
        _flood(store, 20)
        assert store.locate(session) == [TierKind.CPU] * 8


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), 24 * 3600 + 1, "10", True, None])
def test_bad_seconds_are_one_clear_error_and_change_nothing(tmp_path: Path, seconds: object) -> None:
    with _store(tmp_path) as store:
        tokens = list(range(4 * BLOCK))
        store.store(tokens, make_kv(len(tokens)))
        with pytest.raises(InvalidInputError, match="retain seconds"):
            store.retain(tokens, seconds)  # type: ignore[arg-type]
        assert store.retain(tokens, 1) == (4, 0)


@pytest.mark.parametrize("share", [0, 1.5, -0.1, "half", True])
def test_a_bad_retain_share_is_a_config_error(tmp_path: Path, share: object) -> None:
    with pytest.raises(ConfigError, match="retain_share"):
        StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=CPU_BLOCKS * LAYOUT.block_bytes(BLOCK),
                    retain_share=share)  # type: ignore[arg-type]
