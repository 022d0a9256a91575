"""Eviction priority (`KVCacheStore.prioritize`, `blocks.prioritize`): a "low" prefix is the
first victim in the CPU tier under every eviction policy and in the pool's free queue while
older normal blocks survive; a "high" prefix survives a flood within the tenant's
`retain_share`, the rest clipped, and a tenant's newer high blocks take over from its older
ones; "normal" ends high; a bad priority is one clear error and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import KVCacheStore, Priority, PriorityResult, StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.hashing import ExtraKeys
from tests.conftest import BLOCK, LAYOUT, POOL_DEVICE, make_kv
from tiers.keys import TierKind
from tiers.policies.eviction import EVICTION_POLICIES

CPU_BLOCKS = 16


def _store(tmp_path: Path, eviction: str = "lru", **kw: object) -> KVCacheStore:
    return KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=CPU_BLOCKS * LAYOUT.block_bytes(BLOCK),
                                    cpu_eviction=eviction, disk_path=str(tmp_path / "d"), disk_bytes=16 << 20,
                                    disk_sync=False, **kw))


def _put(store: KVCacheStore, start: int, blocks: int, salt: ExtraKeys | None = None) -> list[int]:
    tokens = list(range(start, start + blocks * BLOCK))
    store.store(tokens, make_kv(len(tokens), seed=start), extra_keys=salt)
    return tokens


def _in_cpu(store: KVCacheStore, tokens: list[int], salt: ExtraKeys | None = None) -> int:
    """Leading blocks of `tokens` held in the CPU tier."""
    where = store.locate(tokens, extra_keys=salt)
    return next((i for i, t in enumerate(where) if t is not TierKind.CPU), len(where))


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES.names()))
@pytest.mark.parametrize("low", [True, False])
def test_a_low_prefix_is_evicted_first_and_older_normal_blocks_survive(tmp_path: Path, eviction: str,
                                                                      low: bool) -> None:
    with _store(tmp_path, eviction) as store:
        old = _put(store, 0, 6)  # older, normal: a session's context
        job = _put(store, 10_000, 6)  # newer: a one-off batch job
        if low:
            assert store.prioritize(job, "low") == PriorityResult(6, 0)
        _put(store, 20_000, 8)  # 6 + 6 + 8 in 16: four blocks must leave the CPU tier
        if low:
            assert _in_cpu(store, old) == 6  # every older normal block survives
            assert _in_cpu(store, job) == 2  # the job's tail left first: its prefix is still usable
            assert store.locate(job)[2:] == [TierKind.DISK] * 4  # demoted as usual, not lost
        else:  # the control, under every policy: the older prefix is the one that goes
            assert _in_cpu(store, old) < 6 and _in_cpu(store, job) == 6
        store.check_integrity()


def test_a_low_prefix_goes_first_in_the_pools_free_queue(tmp_path: Path) -> None:
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, pool_blocks=8, pool_device=POOL_DEVICE)
    with KVCacheStore(cfg) as store:
        old = _put(store, 0, 4)
        job = _put(store, 10_000, 4)
        assert store.prioritize(job, Priority.LOW).num_applied == 4
        _put(store, 20_000, 2)
        assert store.locate(old) == [TierKind.POOL] * 4
        assert store.locate(job) == [TierKind.POOL] * 2 + [TierKind.CPU] * 2  # the tail went first, down a tier
        store.check_integrity()


def test_a_high_prefix_survives_a_flood_within_the_budget_and_the_rest_is_clipped(tmp_path: Path) -> None:
    with _store(tmp_path, retain_share=0.5) as store:  # 8 of 16 blocks per tenant
        sys_prompt = _put(store, 0, 4)
        assert store.prioritize(sys_prompt, "high") == PriorityResult(4, 0)
        for i in range(12):
            _put(store, 100_000 + i * 1000, 4)  # 48 blocks through the tier
        assert _in_cpu(store, sys_prompt) == 4
        long = _put(store, 50_000, 10)  # 10 more high blocks than the 4 the budget has left
        assert store.prioritize(long, "high") == PriorityResult(8, 2)  # the older high ones gave way
        for i in range(12):
            _put(store, 200_000 + i * 1000, 4)
        assert _in_cpu(store, long) == 8  # within the budget, its prefix first
        assert _in_cpu(store, sys_prompt) == 0  # back to normal: the flood took it
        assert store.prioritize(list(range(900_000, 900_000 + 2 * BLOCK)), "high") == PriorityResult(0, 2)
        assert len(store.blocks.retention) == 8  # type: ignore[attr-defined]  # nothing gave way for blocks not held
        store.check_integrity()


def test_one_tenants_high_blocks_never_displace_anothers(tmp_path: Path) -> None:
    a, b = ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")
    with _store(tmp_path, retain_share=0.25) as store:  # 4 of 16 blocks per tenant
        mine = _put(store, 0, 4, a)
        assert store.prioritize(mine, "high", extra_keys=a) == PriorityResult(4, 0)
        theirs = _put(store, 5000, 6, b)
        assert store.prioritize(theirs, "high", extra_keys=b) == PriorityResult(4, 2)
        for i in range(8):
            _put(store, 100_000 + i * 1000, 4)
        assert _in_cpu(store, mine, a) == 4 and _in_cpu(store, theirs, b) == 4
        store.check_integrity()


def test_normal_ends_high_and_low_ends_it_too(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        a, b = _put(store, 0, 4), _put(store, 5000, 4)
        assert store.prioritize(a, "high").num_applied == 4 and store.prioritize(b, "high").num_applied == 4
        assert store.prioritize(a, "normal") == PriorityResult(4, 0)
        assert store.prioritize(b, "low") == PriorityResult(4, 0)
        assert len(store.blocks.retention) == 0  # type: ignore[attr-defined]
        for i in range(6):
            _put(store, 100_000 + i * 1000, 4)
        assert _in_cpu(store, a) == 0 and _in_cpu(store, b) == 0
        store.check_integrity()


def test_high_keeps_a_retained_block_charged_once(tmp_path: Path) -> None:
    with _store(tmp_path, retain_share=0.5) as store:
        a = _put(store, 0, 6)
        assert store.retain(a, 60) == (6, 0)
        assert store.prioritize(a, "high") == PriorityResult(6, 0)  # already retained: no new charge
        assert store.retain(a, 1) == (6, 0)  # a shorter retain does not end high
        assert len(store.blocks.retention) == 6  # type: ignore[attr-defined]
        store.check_integrity()


@pytest.mark.parametrize("bad", ["urgent", "LOW", "", None, 1, True, b"low"])
def test_a_bad_priority_is_one_clear_error_and_changes_nothing(tmp_path: Path, bad: object) -> None:
    with _store(tmp_path) as store:
        a = _put(store, 0, 4)
        store.prioritize(a, "high")
        with pytest.raises(InvalidInputError, match="priority must be one of low, normal, high, got") as err:
            store.prioritize(a, bad)  # type: ignore[arg-type]
        assert repr(bad)[:20] in str(err.value)
        with pytest.raises(InvalidInputError, match="priority must be one of"):
            store.blocks.prioritize(store.keys(a), bad)  # type: ignore[arg-type]
        assert len(store.blocks.retention) == 4  # type: ignore[attr-defined]
