"""Eviction policies and the residency that runs them: invariants under random operation
sequences, each policy's defining behaviour, pins, prefixes and rollback."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest

from bench.trace_sim import SimTier, Stack
from kvstore.errors import ConfigError
from tiers.cpu.residency import Residency
from tiers.policies.eviction import (
    EVICTION_POLICIES,
    EvictionConfig,
    EvictionKind,
    EvictionPolicy,
    eviction_config,
    make_policy,
    parse_eviction,
    ratio_field,
)
from tiers.policies.lfu import LFUConfig, LFUPolicy
from tiers.policies.s3fifo import S3FIFOConfig, S3FIFOPolicy

KINDS = list(EvictionKind)


def drive(policy: EvictionPolicy[int], seed: int, steps: int = 3000) -> None:
    """Random operations, the policy's integrity checked after each; returns nothing but
    fails on the first broken invariant or a pop of a key not held."""
    rng = random.Random(seed)
    held: set[int] = set()
    next_key = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.35 or not held:
            policy.insert(next_key)
            held.add(next_key)
            next_key += 1 if rng.random() < 0.8 else -min(next_key, rng.randrange(1, 30))  # re-inserts meet ghosts
            while next_key in held:
                next_key += 1
        elif op < 0.55:
            policy.access(rng.choice(sorted(held)))
        elif op < 0.65:
            policy.refresh(rng.choice(sorted(held)))
        elif op < 0.72:
            key = rng.choice(sorted(held))
            policy.remove(key)
            held.discard(key)
        else:
            key = policy.pop()
            assert key in held
            if rng.random() < 0.2:
                policy.restore(key)
            else:
                held.discard(key)
        assert len(policy) == len(held)
        assert all(k in policy for k in held)
        policy.check_integrity()
    assert sorted(policy.order()) == sorted(held)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_every_invariant(kind: EvictionKind, seed: int) -> None:
    drive(make_policy(kind, 50), seed)


@pytest.mark.parametrize("kind", KINDS)
def test_pop_of_empty_policy_and_misuse_raise(kind: EvictionKind) -> None:
    policy: EvictionPolicy[int] = make_policy(kind, 4)
    with pytest.raises(IndexError):
        policy.pop()
    with pytest.raises(KeyError):
        policy.access(7)
    with pytest.raises(KeyError):
        policy.remove(7)
    with pytest.raises(ValueError, match="capacity > 0"):
        make_policy(kind, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_restore_undoes_a_pop(kind: EvictionKind) -> None:
    """A popped key put back is popped again before any other (nothing else changed)."""
    policy: EvictionPolicy[int] = make_policy(kind, 8)
    for k in range(8):
        policy.insert(k)
    for k in (2, 5):
        policy.access(k)
    first = policy.pop()
    policy.restore(first)
    policy.check_integrity()
    assert policy.pop() == first


def test_parse_eviction_names_the_choices() -> None:
    assert parse_eviction("arc") is EvictionKind.ARC
    with pytest.raises(ConfigError, match=r"cpu_eviction must be one of \['lru', 's3fifo', 'arc', 'lfu'\], got 'mru'"):
        parse_eviction("mru", "cpu_eviction")


def scan_survivors(kind: EvictionKind) -> set[int]:
    """A tier of 10: keys 0..4 used twice, then a scan of 30 keys used once."""
    res: Residency[int] = Residency(10, kind)
    for k in range(5):
        res.add(k)
    res.end_put()
    res.touch(list(range(5)))
    res.end_put()
    for k in range(100, 130):
        if len(res) == 10:
            res.commit(res.take_victims(1))
        res.add(k)
        res.end_put()
    res.check_integrity()
    return {k for k in range(5) if k in res}


def test_lru_loses_its_reused_keys_to_a_scan_and_the_others_keep_them() -> None:
    assert scan_survivors(EvictionKind.LRU) == set()
    for kind in (EvictionKind.S3FIFO, EvictionKind.ARC, EvictionKind.LFU):
        assert scan_survivors(kind) == set(range(5)), kind


def test_lfu_counts_saturate_and_age() -> None:
    policy: LFUPolicy[int] = LFUPolicy(2)  # halves every 16 uses
    policy.insert(1)
    for _ in range(14):
        policy.access(1)
    assert policy.count(1) == 15  # saturated
    policy.insert(2)  # the 16th use: every count halved
    assert (policy.count(1), policy.count(2)) == (7, 1)
    assert policy.pop() == 2
    policy.check_integrity()


def test_uses_count_once_per_epoch() -> None:
    """The calls of one request (read, promote, store) are one use; the next epoch's are new."""
    res: Residency[int] = Residency(4, EvictionKind.LFU)
    res.add(1)
    res.touch([1])
    res.touch([1])
    policy = res.policy
    assert isinstance(policy, LFUPolicy) and policy.count(1) == 1
    res.end_put()
    res.touch([1])
    res.touch([1])
    assert policy.count(1) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_blocks_are_never_victims(kind: EvictionKind) -> None:
    res: Residency[int] = Residency(6, kind)
    for k in range(6):
        res.add(k)
    for k in (0, 1, 2):
        assert res.pin(k)
    assert not res.pin(99)
    with pytest.raises(RuntimeError, match="only 3 blocks are evictable"):
        res.take_victims(4)
    victims = res.take_victims(3)
    assert sorted(victims) == [3, 4, 5]
    res.commit(victims)
    res.check_integrity()
    res.unpin(0)
    with pytest.raises(RuntimeError, match="not pinned"):
        res.unpin(0)
    res.unpin(42)  # absent: skipped


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefix_outlives_its_held_children(kind: EvictionKind) -> None:
    """Chains added prefix first, then the prefix touched last: whatever the policy, no block is
    evicted while a block linked to it is held."""
    res: Residency[int] = Residency(20, kind)
    rng = random.Random(5)
    parent_of: dict[int, int | None] = {}
    next_id = 0
    for step in range(400):
        chain = []
        prev = None
        for _ in range(rng.randrange(1, 6)):
            chain.append(next_id)
            parent_of[next_id] = prev
            prev = next_id
            next_id += 1
        new = [b for b in chain if b not in res]
        extra = len(res) + len(new) - 20
        if extra > 0:
            victims = res.take_victims(extra)
            for v in victims:  # no victim has a held child left
                assert not any(parent_of.get(c) == v and c in res and c not in victims for c in parent_of)
            res.commit(victims)
        for b in new:
            res.add(b, parent_of[b])
        if step % 7 == 0:  # an old chain's leaf used again: its prefix must stay with it
            res.touch([b for b in parent_of if b in res][:1])
        res.end_put()
        res.check_integrity()
    assert res.num_stranded == 0


def test_prefixes_are_evicted_only_when_their_leaves_are_pinned() -> None:
    res: Residency[int] = Residency(3, EvictionKind.LRU)
    res.add(10)
    res.add(11, parent=10)
    res.add(12)
    res.pin(11)
    res.pin(12)
    assert res.take_victims(1) == [10]  # the only evictable block: stranding is counted
    assert res.num_stranded == 1


@pytest.mark.parametrize("kind", KINDS)
def test_restore_after_a_failed_eviction_changes_nothing(kind: EvictionKind) -> None:
    res: Residency[int] = Residency(8, kind)
    for k in range(8):
        res.add(k, k - 1 if k else None)
        res.end_put()
    victims = res.take_victims(3)
    res.restore(victims)
    res.check_integrity()
    assert len(res) == 8 and res.take_victims(3) == victims


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_tiers_never_exceed_capacity(kind: EvictionKind) -> None:
    rng = random.Random(3)
    disk = SimTier(30, kind)
    top = SimTier(10, kind, below=disk, demote_admission="seen:2")
    stack = Stack([top, disk], [])
    for _ in range(300):
        start = rng.randrange(0, 60)
        stack.serve(list(range(start, start + rng.randrange(1, 14))))
        assert len(top.res) <= 10 and len(disk.res) <= 30
        top.res.check_integrity()
        disk.res.check_integrity()
    assert top.admission.num_refused > 0 and top.admission.num_admitted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_trim_history_keeps_what_a_smaller_tier_would(kind: EvictionKind) -> None:
    """A policy that remembered many evicted keys, told its tier now holds 2 blocks for it,
    keeps at most what a 2-block policy keeps, the most recently evicted; the next eviction
    does not grow it past its own limit, and a limit is never above its own capacity's."""
    policy: EvictionPolicy[int] = make_policy(kind, 50)
    for key in range(200):
        policy.insert(key)
    for _ in range(150):
        policy.pop()
    assert policy.num_remembered <= policy.history_limit(50)
    if kind is EvictionKind.LRU:
        assert policy.num_remembered == policy.history_limit(2) == 0
    else:
        assert policy.num_remembered > policy.history_limit(2) > 0
    last = policy.pop()
    policy.trim_history(2)
    assert policy.num_remembered <= policy.history_limit(2)
    assert policy.history_limit(10_000) == policy.history_limit(50)
    policy.check_integrity()
    if kind is not EvictionKind.LRU:  # the key evicted last is still remembered (and leaves the history)
        kept = policy.num_remembered
        policy.insert(last)
        assert policy.num_remembered == kept - 1
        policy.check_integrity()


def test_each_policy_is_registered_with_a_config_of_its_own() -> None:
    assert EVICTION_POLICIES.names()[:4] == ["lru", "s3fifo", "arc", "lfu"] == [k.value for k in EvictionKind]
    assert eviction_config("s3fifo") == S3FIFOConfig() and eviction_config(EvictionKind.ARC).name == "arc"
    config = eviction_config({"type": "s3fifo", "small_share": 0.5, "ghost_x": 1.0}, "w")
    policy = make_policy(config, 10)
    assert isinstance(policy, S3FIFOPolicy)
    for k in range(5):  # a small queue of half the tier holds the five new keys; nothing is a ghost yet
        policy.insert(k)
    policy.check_integrity()
    assert [policy.pop() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert isinstance(make_policy(LFUConfig(history_x=0.5), 4), LFUPolicy)
    with pytest.raises(ConfigError, match=r"^w: S3FIFOConfig\.small_share must be a number in \(0, 1\), got 1\.5$"):
        eviction_config({"type": "s3fifo", "small_share": 1.5}, "w")
    with pytest.raises(ConfigError, match=r"^w: ARCConfig\.ghost_x must be a number in \(0, 1e\+06\), got True$"):
        eviction_config({"type": "arc", "ghost_x": True}, "w")
    with pytest.raises(ConfigError, match=r"^w='fifo2' is not a registered eviction policy; registered: \['lru', "):
        eviction_config("fifo2", "w")


@dataclass(frozen=True)
class _SpanConfig(EvictionConfig):
    """A config from outside kvstrata: a ratio field, and a check of its own other field."""

    ghost_x: float = ratio_field(2.0)
    min_blocks: int = 1

    def __post_init__(self) -> None:  # the base's not called, as configs before ratio_field wrote it
        if not isinstance(self.min_blocks, int) or self.min_blocks < 1:
            raise ConfigError(f"_SpanConfig.min_blocks must be an int > 0, got {self.min_blocks!r}")

    def make(self, capacity_blocks: int) -> EvictionPolicy[Any]:
        return make_policy("lru", capacity_blocks)


@dataclass(frozen=True)
class _PoliteSpanConfig(_SpanConfig):
    def __post_init__(self) -> None:
        super().__post_init__()
        EvictionConfig.__post_init__(self)  # the base's as well: the same check twice


def test_a_ratio_field_is_checked_though_its_config_has_a_post_init_of_its_own() -> None:
    for cls in (_SpanConfig, _PoliteSpanConfig):
        name = cls.__name__
        with pytest.raises(ConfigError, match=rf"^{name}\.ghost_x must be a number in \(0, 1e\+06\), got -1$"):
            cls(ghost_x=-1)
        with pytest.raises(ConfigError, match=rf"^{name}\.ghost_x must be a number in \(0, 1e\+06\), got 'x'$"):
            cls(ghost_x="x")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"^_SpanConfig\.min_blocks must be an int > 0, got 0$"):
            cls(min_blocks=0)
        config = cls(ghost_x=3)
        assert config.ghost_x == 3.0 and type(config.ghost_x) is float and cls().ghost_x == 2.0


def test_a_residency_runs_the_policy_its_config_makes() -> None:
    res: Residency[int] = Residency(10, S3FIFOConfig(small_share=0.5))
    assert res.eviction == S3FIFOConfig(small_share=0.5) and isinstance(res.policy, S3FIFOPolicy)
    assert Residency(10, "lfu").eviction == LFUConfig()
