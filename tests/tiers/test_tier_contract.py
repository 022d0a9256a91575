"""One contract suite, run against every registered built-in tier (the registry's, opened
through its config), the CPU tier under every registered eviction policy.

A tier shared by many hosts (`traits.shared`: the remote tier, against a real `redis-server`;
the Mooncake tier, against a real `mooncake_master`; the shared-filesystem tier, on a real
directory) is bounded by its server or by all its hosts together, not by a capacity of its own,
and counts no blocks: the tests of
eviction order and capacity are for the others."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.errors import StoreClosedError
from kvstore.hashing import BlockHash
from kvstore.tier_stack import TierStack
from tests.conftest import BLOCK, LAYOUT
from tests.mooncake_fixtures import MooncakeMaster, mooncake_master
from tests.redis_fixtures import redis_server
from tests.switches import switches
from tiers import changes as changes_mod
from tiers.base import Tier
from tiers.changes import ChangeKind
from tiers.cpu.config import CPUTierConfig
from tiers.cpu.tier import CPUTier
from tiers.disk.config import DiskTierConfig
from tiers.disk.tier import LMDBTier, bytes_per_block
from tiers.keys import BlockKey
from tiers.policies.eviction import EVICTION_POLICIES
from tiers.pool.config import PoolTierConfig
from tiers.remote.config import RemoteTierConfig
from tiers.sharedfs.config import SharedFSTierConfig
from tiers.tier_config import BUILTIN_TIERS, TIERS, TierConfig, TierContext, tier_config

SHAPE = LAYOUT.block_shape(BLOCK)
BLOCK_BYTES = LAYOUT.block_bytes(BLOCK)


def key(i: int) -> BlockKey:
    return BlockKey(BlockHash(i.to_bytes(16, "little")), i.to_bytes(4, "little") * BLOCK)


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g).to(LAYOUT.dtype)


def make_lmdb(tmp: Path, capacity: int) -> Tier:
    capacity_bytes = capacity * bytes_per_block(BLOCK_BYTES)
    return LMDBTier(str(tmp / "db"), capacity_bytes, SHAPE, LAYOUT.dtype, sync=False)


Config = Callable[[Path, int, Any], TierConfig]  # (a fresh directory, capacity in blocks, its server's fixture)
# The config of each built-in tier, holding `capacity` blocks (by registered name). A tier
# registered among the built-ins without one here fails `test_every_built_in_tier_is_in_the_contract`.
CONFIGS: dict[str, Config] = {
    "pool": lambda tmp, n, url: PoolTierConfig(n, device=switches().pool_device),
    "cpu": lambda tmp, n, url: CPUTierConfig(n * BLOCK_BYTES),
    "disk": lambda tmp, n, url: DiskTierConfig(str(tmp / "db"), n * bytes_per_block(BLOCK_BYTES), sync=False),
    "remote": lambda tmp, n, url: RemoteTierConfig(url, timeout_s=5),
    "mooncake": lambda tmp, n, master: tier_config(master.tier(timeout_s=5)),
    "sharedfs": lambda tmp, n, url: SharedFSTierConfig(str(tmp / "shared"), n * (BLOCK_BYTES + 4096)),
}
SERVERS = {"remote": "redis_url", "mooncake": "mooncake_server"}  # the fixture of a shared tier's server
BUILT_IN = [e.name for e in TIERS.entries() if e.config.__module__ in BUILTIN_TIERS]
POLICIES = [e.name for e in EVICTION_POLICIES.entries() if e.config.__module__.startswith("tiers.")]  # built in
# The CPU tier under every registered eviction policy (and once with quotas and demotion
# admission on): the contract holds whatever the policy; the LRU-named tests hold for each.
VARIANTS: dict[str, Config] = {
    **{name: CONFIGS[name] for name in BUILT_IN if name in CONFIGS},
    **{f"cpu-{policy}": (lambda p: lambda tmp, n, url: CPUTierConfig(n * BLOCK_BYTES, eviction=p))(policy)
       for policy in POLICIES if policy != "lru"},
    "cpu-arc-quota": lambda tmp, n, url: CPUTierConfig(n * BLOCK_BYTES, eviction="arc",  # type: ignore[arg-type]
                                                       tenant_quota_bytes=2 * BLOCK_BYTES, admission="seen:2"),
}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A redis-server for the remote tier (started once a test of it asks)."""
    with redis_server() as server:
        yield server.url


@pytest.fixture(scope="module")
def mooncake_server() -> Iterator[MooncakeMaster]:
    """A mooncake_master for the Mooncake tier (started once a test of it asks)."""
    with mooncake_master() as master:
        yield master


def test_every_built_in_tier_is_in_the_contract() -> None:
    assert BUILT_IN == ["pool", "cpu", "disk", "remote", "mooncake", "sharedfs"] and set(BUILT_IN) <= set(CONFIGS)
    assert POLICIES == ["lru", "s3fifo", "arc", "lfu"]


@pytest.fixture(params=list(VARIANTS))
def tier_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[int], Tier]]:
    made: list[Tier] = []
    config_of = VARIANTS[request.param]
    server = request.getfixturevalue(SERVERS[request.param]) if request.param in SERVERS else None

    def factory(capacity: int) -> Tier:
        namespace = BlockHash(os.urandom(16))  # a fresh one per tier: a shared server holds every test's blocks
        t = config_of(tmp_path, capacity, server).open(TierContext(SHAPE, LAYOUT.dtype, namespace))
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()


def bounded(tier: Tier) -> bool:
    """Whether the tier holds at most its own capacity, and counts its blocks (not a server's)."""
    return not tier.traits.shared


def put(tier: Tier, ids: list[int]) -> int:
    """Store the blocks `ids` (a tier that writes in the background: until they are written)."""
    n = tier.put([key(i) for i in ids], [block(i) for i in ids])
    assert tier.flush()
    return n


def get(tier: Tier, ids: list[int]) -> tuple[int, list[torch.Tensor]]:
    dsts = [torch.empty(SHAPE, dtype=LAYOUT.dtype) for _ in ids]
    return tier.get_into([key(i) for i in ids], dsts), dsts


def test_put_get_round_trip_is_bit_exact(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(8)
    assert put(tier, [3, 2, 1]) == 3
    tier.check_integrity()
    n, dsts = get(tier, [1, 2, 3])
    assert n == 3
    for i, d in zip([1, 2, 3], dsts):
        assert torch.equal(d.view(torch.int16), block(i).view(torch.int16))
    assert len(tier) == (3 if bounded(tier) else 0)  # a server's tier counts no blocks


def test_get_into_strided_destination(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(4)
    put(tier, [1, 0])
    out = torch.zeros(LAYOUT.block_shape(2 * BLOCK), dtype=LAYOUT.dtype)
    views = [out[:, :, :BLOCK], out[:, :, BLOCK:]]
    assert tier.get_into([key(0), key(1)], views) == 2
    assert torch.equal(out[:, :, BLOCK:], block(1))


def test_match_prefix_stops_at_first_miss(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(8)
    put(tier, [0, 1, 3])
    hashes = [key(i).block_hash for i in range(4)]
    assert tier.match_prefix(hashes) == 2
    assert tier.match_prefix([]) == 0
    assert tier.match_prefix(hashes[2:]) == 0
    assert tier.match_prefix(hashes, 1) == 1 and tier.match_prefix(hashes, 4) == 0
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        tier.match_prefix(hashes, -1)  # (it would count from the prompt's end)


def test_get_stops_at_first_missing_block(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(8)
    put(tier, [0, 2])
    n, _ = get(tier, [0, 1, 2])
    assert n == 1
    assert get(tier, [])[0] == 0


def test_put_of_held_block_writes_nothing(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(8)
    assert put(tier, [0, 1]) == 2
    if not bounded(tier):
        pytest.skip("a server's tier queues every write without asking what it holds (a SET again is harmless)")
    assert put(tier, [1, 2]) == 1
    assert len(tier) == 3
    tier.check_integrity()


def test_lru_eviction_order_and_touch(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(3)
    if not bounded(tier):
        pytest.skip("a server's tier evicts as its server does (maxmemory-policy)")
    put(tier, [0, 1, 2])  # eviction order: 0 first
    tier.touch([key(0).block_hash])  # now 1 is least recent
    put(tier, [3])
    tier.check_integrity()
    held = {i for i in range(4) if tier.match_prefix([key(i).block_hash])}
    assert 1 not in held and {0, 3} <= held


def test_put_eviction_order_keeps_prefix(tier_factory: Callable[[int], Tier]) -> None:
    """A sequence stored tail first loses its tail first."""
    tier = tier_factory(3)
    if not bounded(tier):
        pytest.skip("a server's tier evicts as its server does (maxmemory-policy)")
    put(tier, [4, 3, 2, 1, 0])  # tail (4) first: most evictable
    held = sorted(i for i in range(5) if tier.match_prefix([key(i).block_hash]))
    assert held == [0, 1, 2]
    tier.check_integrity()


def test_token_mismatch_is_a_miss_and_deletes(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(4)
    put(tier, [0])
    wrong = BlockKey(key(0).block_hash, b"\x09" * (4 * BLOCK))
    dst = torch.empty(SHAPE, dtype=LAYOUT.dtype)
    assert tier.get_into([wrong], [dst]) == 0
    assert tier.match_prefix([key(0).block_hash]) == 0
    assert tier.stats().num_corrupt == 1
    tier.check_integrity()


def test_discard_and_clear(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(8)
    put(tier, [0, 1, 2])
    assert tier.discard([key(1).block_hash, key(7).block_hash]) == 1
    assert tier.match_prefix([key(1).block_hash]) == 0
    tier.check_integrity()
    tier.clear()
    assert len(tier) == 0
    tier.check_integrity()
    assert put(tier, [5]) == 1


def test_stats_count_blocks_and_bytes(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(8)
    put(tier, [0, 1])
    get(tier, [0, 1])
    s = tier.stats()
    assert s.num_blocks == (2 if bounded(tier) else 0) and s.num_puts == 2 and s.num_hits == 2
    # Mooncake's client tells no usage (its master's metrics do): its tier reports 0 bytes.
    assert s.used_bytes >= 2 * BLOCK_BYTES or (tier.kind == "mooncake" and s.used_bytes == 0)
    assert s.capacity_blocks >= 8


def test_closed_tier_raises(tier_factory: Callable[[int], Tier]) -> None:
    tier = tier_factory(2)
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(StoreClosedError):
        put(tier, [0])
    with pytest.raises(StoreClosedError):
        tier.match_prefix([key(0).block_hash])


@pytest.mark.parametrize("eviction", POLICIES)
def test_cpu_demotes_to_lower_tier(tmp_path: Path, eviction: str) -> None:
    """Through a tier stack: the CPU tier sees only the `Below` view the stack gives it."""
    disk = LMDBTier(str(tmp_path / "db"), 1 << 20, SHAPE, LAYOUT.dtype, sync=False)
    cpu = CPUTier(2, SHAPE, LAYOUT.dtype, eviction=eviction)
    TierStack([cpu, disk], write_through=False)
    try:
        put(cpu, [2, 1, 0])  # 2 is most evictable and overflows straight to disk
        assert disk.match_prefix([key(2).block_hash]) == 1
        put(cpu, [3])  # evicts 1 (least recent) down to disk
        assert cpu.match_prefix([key(1).block_hash]) == 0
        assert disk.match_prefix([key(1).block_hash]) == 1
        n, dsts = get(disk, [1])
        assert n == 1 and torch.equal(dsts[0], block(1))
        cpu.check_integrity()
        disk.check_integrity()
    finally:
        cpu.close()
        disk.close()


@pytest.mark.parametrize("eviction", POLICIES)
def test_cpu_pinned_blocks_are_not_evicted(eviction: str) -> None:
    cpu = CPUTier(2, SHAPE, LAYOUT.dtype, eviction=eviction)
    put(cpu, [0, 1])
    assert cpu.pin([key(0).block_hash]) == 1
    put(cpu, [2, 3])  # only one evictable slot (block 1) plus none free
    cpu.check_integrity()
    assert cpu.match_prefix([key(0).block_hash]) == 1
    cpu.unpin([key(0).block_hash])
    cpu.check_integrity()
    with pytest.raises(RuntimeError, match="not pinned"):
        cpu.unpin([key(0).block_hash])


def test_lmdb_survives_reopen_with_lru_order(tmp_path: Path) -> None:
    t = make_lmdb(tmp_path, 3)
    put(t, [0, 1, 2])
    t.touch([key(0).block_hash])
    t.close()
    t = make_lmdb(tmp_path, 3)
    try:
        assert t.match_prefix([key(i).block_hash for i in range(3)]) == 3
        put(t, [9])  # evicts block 1: block 0's touch was persisted on close
        assert t.match_prefix([key(1).block_hash]) == 0
        assert t.match_prefix([key(0).block_hash]) == 1
        t.check_integrity()
    finally:
        t.close()


def test_lmdb_capacity_is_respected(tmp_path: Path) -> None:
    t = make_lmdb(tmp_path, 5)
    try:
        for i in range(20):
            put(t, [i])
            t.check_integrity()
        s = t.stats()
        assert s.used_bytes <= s.capacity_bytes
        assert len(t) <= 5 and s.num_evictions >= 15
    finally:
        t.close()


def test_every_put_and_read_keeps_capacity_and_integrity(tier_factory: Callable[[int], Tier]) -> None:
    """Random sequences of puts, reads, touches, pins and discards: never over capacity, every
    read bit-exact, integrity after each operation."""
    import random

    tier = tier_factory(6)
    rng = random.Random(11)
    pinned: list[int] = []
    for _ in range(150):
        start = rng.randrange(0, 20)
        ids = list(range(start, start + rng.randrange(1, 5)))
        op = rng.random()
        if op < 0.5:
            put(tier, ids[::-1])
        elif op < 0.75:
            n, dsts = get(tier, ids)
            for i, d in zip(ids[:n], dsts):
                assert torch.equal(d.view(torch.int16), block(i).view(torch.int16))
        elif op < 0.85:
            tier.touch([key(i).block_hash for i in ids])
        elif op < 0.95 and tier.pin([key(ids[0]).block_hash]):
            pinned.append(ids[0])
        elif pinned:
            tier.unpin([key(pinned.pop()).block_hash])
        else:
            tier.discard([key(i).block_hash for i in ids])
        assert len(tier) <= tier.capacity_blocks
        tier.check_integrity()
        for i in pinned:  # a tier that pins (the CPU tier) never evicts a pinned block
            assert tier.match_prefix([key(i).block_hash]) == 1


@pytest.mark.parametrize("eviction", POLICIES)
def test_cpu_put_keeps_the_held_prefix_over_its_new_tail(eviction: str) -> None:
    """A request that extends a cached prefix stores its new tail; the next eviction takes
    that tail, not the prefix (which would strand the tail: unreachable without it)."""
    cpu = CPUTier(4, SHAPE, LAYOUT.dtype, eviction=eviction)
    put(cpu, [1, 0])  # sequence 0, 1
    put(cpu, [3, 2])  # another sequence
    put(cpu, [5, 4, 1, 0])  # 0, 1 extended by 4, 5: 2 and 3 make room
    put(cpu, [7, 6])  # room for 2 more: the tail 4, 5 goes, the prefix 0, 1 stays
    assert cpu.match_prefix([key(i).block_hash for i in (0, 1)]) == 2
    cpu.check_integrity()
    cpu.close()


def whole_key(i: int) -> BlockKey:
    """`key(i)` with a parent (block i - 1; a root's is a seed) and extras, as KV events need."""
    parent = key(i - 1).block_hash if i else b"seed" * 4
    return key(i)._replace(parent=parent, extras=b"")


def _settled(tier: Tier) -> None:
    """Wait for a tier that writes in the background (a server's) to have sent its writes."""
    flush = getattr(tier, "flush", None)
    if callable(flush):
        assert flush() is not False


def test_changes_are_recorded_in_order_once_taken_and_taken_once(tier_factory: Callable[[int], Tier]) -> None:
    """A tier records what entered and left it, with the keys it was given, in order, from
    the first `take_changes` on (a tier nobody asks keeps nothing), and forgets what it handed out."""
    tier = tier_factory(4)
    put(tier, [9])
    assert tier.take_changes() == [], "nothing recorded before anyone asked"
    keys = [whole_key(i) for i in (2, 1, 0)]
    assert tier.put(keys, [block(i) for i in (2, 1, 0)]) == 3
    _settled(tier)
    tier.discard([key(1).block_hash])
    changes = tier.take_changes()
    assert [(c.tier, c.kind) for c in changes] == [(tier.kind, ChangeKind.ENTERED), (tier.kind, ChangeKind.LEFT)]
    assert sorted(changes[0].keys) == sorted(keys), "entered blocks carry their whole keys"
    assert [k.block_hash for k in changes[1].keys] == [key(1).block_hash]
    assert tier.take_changes() == []


def test_a_change_log_nobody_drains_stays_bounded_and_restates_the_tier(
        tier_factory: Callable[[int], Tier], monkeypatch: pytest.MonkeyPatch) -> None:
    """A log that is not drained holds at most MAX_CHANGED_KEYS blocks: past that it forgets
    its changes (counted) and the next take starts with a RESYNC naming what the tier holds;
    changes after the overflow follow it."""
    monkeypatch.setattr(changes_mod, "MAX_CHANGED_KEYS", 3)
    tier = tier_factory(8)
    if tier.traits.shared:
        pytest.skip("a server's tier keeps no keys to restate: its RESYNC names nothing (readers forget its blocks)")
    tier.take_changes()
    for ids in ([1, 0], [3, 2], [5, 4]):  # 6 blocks recorded > 3: the log overflows
        assert tier.put([whole_key(i) for i in ids], [block(i) for i in ids]) == 2
    assert tier.num_changes_dropped >= 4
    changes = tier.take_changes()
    assert changes[0].kind is ChangeKind.RESYNC
    assert sorted(changes[0].keys) == sorted(whole_key(i) for i in range(6)), "what the tier holds, whole"
    assert all(c.kind is ChangeKind.ENTERED for c in changes[1:]) and len(changes) <= 2
    assert tier.take_changes() == []
