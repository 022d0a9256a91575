"""`EvictionPolicy.deprioritize` (the "low" priority): under every registered policy a
deprioritized key is the next victim, however hot it was, the last given first; the policies
keep their invariants with it mixed into random operations; a policy from outside kvstrata gets
the protocol's default; a residency moves a prefix so its tail leaves first."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest

from tiers.cpu.residency import Residency
from tiers.policies.eviction import EVICTION_POLICIES, EvictionKind, EvictionPolicy, make_policy

NAMES = sorted(EVICTION_POLICIES.names())


@pytest.mark.parametrize("name", NAMES)
def test_deprioritized_keys_are_the_next_victims_however_hot(name: str) -> None:
    policy: EvictionPolicy[int] = make_policy(name, 20)
    for k in range(20):
        policy.insert(k)
    for _ in range(3):
        for k in range(20):
            policy.access(k)  # every key reused: hot under every policy
    for _ in range(10):
        policy.pop()  # the policies settle their queues (S3-FIFO's main, ARC's t2)
    survivors = sorted(policy.order())
    low = survivors[-3:]  # the most recently used
    for k in low:
        policy.deprioritize(k)
    assert policy.pop_many(3) == low[::-1]  # the last given first: a prefix's tail leaves first
    policy.check_integrity()
    assert sorted(policy.order()) == survivors[:-3]


@pytest.mark.parametrize("name", NAMES)
def test_a_new_low_key_goes_before_older_normal_ones(name: str) -> None:
    policy: EvictionPolicy[int] = make_policy(name, 16)
    for k in range(8):
        policy.insert(k)  # older, used once
    policy.insert(100)
    policy.deprioritize(100)
    assert policy.pop() == 100


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_deprioritize_mixed_into_random_operations_keeps_every_invariant(name: str, seed: int) -> None:
    rng = random.Random(seed)
    policy: EvictionPolicy[int] = make_policy(name, 64)
    held: set[int] = set()
    nxt = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not held:
            policy.insert(nxt)
            held.add(nxt)
            nxt += 1 if rng.random() < 0.8 else -min(nxt, rng.randrange(1, 30))
            while nxt in held:
                nxt += 1
        elif op < 0.55:
            policy.access(rng.choice(sorted(held)))
        elif op < 0.70:
            key = rng.choice(sorted(held))
            policy.deprioritize(key)
            if rng.random() < 0.5:
                assert policy.pop() == key
                held.discard(key)
        elif op < 0.75:
            key = rng.choice(sorted(held))
            policy.remove(key)
            held.discard(key)
        else:
            held.discard(policy.pop())
        assert len(policy) == len(held)
        policy.check_integrity()
    assert sorted(policy.order()) == sorted(held)


class _MRU(EvictionPolicy[Any]):
    """A policy from outside kvstrata: most recent first, no `deprioritize` of its own."""

    kind = EvictionKind.LRU

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[Any, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: Any) -> None:
        self._order[key] = None

    def access(self, key: Any) -> None:
        self._order.move_to_end(key)

    refresh = access

    def remove(self, key: Any) -> None:
        del self._order[key]

    def pop(self) -> Any:
        return self._order.popitem(last=True)[0]

    def restore(self, key: Any) -> None:
        self._order[key] = None

    def order(self) -> Iterator[Any]:
        return reversed(self._order)

    def clear(self) -> None:
        self._order.clear()

    def check_integrity(self) -> None:
        return None


def test_a_policy_from_outside_gets_the_protocols_default() -> None:
    policy = _MRU(8)
    for k in range(5):
        policy.insert(k)
    policy.deprioritize(1)  # remove + restore: where its own `restore` puts the next victim
    assert policy.pop() == 1 and len(policy) == 4


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("quota", [None, 8])
def test_a_residency_sends_a_low_prefix_tail_first_and_keeps_older_blocks(name: str, quota: int | None) -> None:
    res: Residency[int] = Residency(16, name, quota_blocks=quota)
    for k in range(8):
        res.add(k, k - 1 if k else None)  # an older prefix, normal
    chain = list(range(100, 104))
    for i, k in enumerate(chain):
        res.add(k, chain[i - 1] if i else None)
    assert res.deprioritize([*chain, 999]) == 4  # absent keys are ignored
    victims = res.take_victims(4)
    res.commit(victims)
    assert victims == chain[::-1]  # the tail first: the prefix stays reachable as it shrinks
    assert all(k in res for k in range(8))
    res.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_low_victims_put_back_are_again_the_first_to_go(name: str) -> None:
    """An eviction that takes two low keys and a normal one and cannot be carried out puts
    them back as they were: the next eviction takes the same keys in the same order, the
    low ones first (before, ARC and S3-FIFO put a low key back among the normal ones)."""
    policy: EvictionPolicy[int] = make_policy(name, 16)
    for k in range(10):
        policy.insert(k)
    for k in (7, 8, 9):
        policy.deprioritize(k)  # cold: 9, 8, 7 (the last deprioritized goes first)
    victims = policy.pop_many(4)
    assert victims[:3] == [9, 8, 7]
    for key in reversed(victims):
        policy.restore(key)
    policy.check_integrity()
    assert policy.pop_many(4) == victims


@pytest.mark.parametrize("name", ["arc", "s3fifo"])
@pytest.mark.parametrize("capacity, ghost_x", [(16, 0.25), (2, 4.0)])
def test_more_low_victims_than_ghosts_put_back_are_still_low(name: str, capacity: int, ghost_x: float) -> None:
    """An undone eviction of more low keys than the policy keeps ghosts puts every one back
    at the cold front: a small `ghost_x` (16 blocks at 0.25: four ghosts), or a quota
    tenant's policy holding more keys than its capacity (the tier lets a tenant exceed its
    quota). Before, the memory of keys popped from the cold queue was trimmed to the ghost
    limit, so the earliest popped came back among the normal keys, no longer low."""
    from tiers.policies.arc import ARCPolicy
    from tiers.policies.s3fifo import S3FIFOPolicy

    policy: EvictionPolicy[int] = (ARCPolicy if name == "arc" else S3FIFOPolicy)(capacity, ghost_x=ghost_x)
    for k in range(16):
        policy.insert(k)
    for k in range(10):
        policy.deprioritize(k)  # cold: 9, 8, ..., 0
    victims = policy.pop_many(10)
    assert victims == list(range(9, -1, -1))
    for key in reversed(victims):
        policy.restore(key)
    policy.check_integrity()
    assert list(policy.order())[:10] == victims
    assert policy.pop_many(10) == victims
    for k in range(16, 40):  # committed pops are not remembered past the policy's bound
        policy.insert(k)
        policy.deprioritize(k)
        policy.pop()
    policy.check_integrity()
