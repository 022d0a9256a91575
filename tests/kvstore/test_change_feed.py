"""The tiers' changes on their way out of a store (`kvstore/change_feed.py`): tiers record
what entered and left them and hold no callback; the stack hands the changes to its sinks in
the order they happened, whole keys and all, with KV events on and off."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from cli.ports import free_port_pair
from kvevents import wire_hash
from kvstore import KVCacheStore, StoreConfig
from kvstore.hashing import ExtraKeys
from tests.conftest import BLOCK, LAYOUT, make_kv
from tests.kvstore.test_events import Reader
from tests.redis_fixtures import RedisServer, redis_server
from tiers.base import Tier
from tiers.changes import ChangeKind, TierChange
from tiers.keys import BlockKey, TierKind


class Sink:
    """Every change a store's feed hands out, in order."""

    def __init__(self, store: KVCacheStore) -> None:
        self.changes: list[TierChange] = []
        store.changes.add_sink(self.changes.extend)

    def keys(self, tier: TierKind, kind: ChangeKind) -> list[BlockKey]:
        return [k for c in self.changes if c.tier == tier and c.kind is kind for k in c.keys]


def _config(tmp_path: Path, *, events: bool, cpu_blocks: int = 2, **kw: Any) -> StoreConfig:
    port = free_port_pair() if events else None
    return StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK),
                       disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, disk_sync=False,
                       events_endpoint=f"tcp://127.0.0.1:{port}" if events else None, **kw)


@pytest.mark.parametrize("events", [True, False], ids=["events", "no-events"])
def test_a_block_demoted_from_cpu_reaches_the_disk_with_its_whole_key(tmp_path: Path, events: bool) -> None:
    """The CPU tier keeps the key a block was stored under: demoted, the block arrives at the
    disk with its parent, extras and tenant (no tier asks anyone to complete it), the disk
    persists them, and its 'entered' change (and, with events, its `BlockStored`) carries them."""
    extra = ExtraKeys(cache_salt="tenant-a", lora_id="adapter-1")
    tokens = list(range(4 * BLOCK))
    with KVCacheStore(_config(tmp_path, events=events)) as store:
        sink = Sink(store)
        reader = Reader(int(store.config.events_endpoint.rsplit(":", 1)[1])) if events else None
        if reader is not None:  # the welcome first: one that came after the stores would restate them
            reader.welcomed()
        try:
            hashes = store.block_hashes(tokens, extra)
            built = list(store.keys(tokens, extra_keys=extra))
            store.store(tokens, make_kv(len(tokens)), extra_keys=extra)  # 4 blocks, 2 slots: 2 go to disk
            store.store(list(range(500, 500 + 2 * BLOCK)), make_kv(2 * BLOCK))  # evicts the other 2 from the CPU
            disk = {t.kind: t for t in store.tiers}[TierKind.DISK]
            entered = {k.block_hash: k for k in sink.keys(TierKind.DISK, ChangeKind.ENTERED)}
            assert set(entered) == set(hashes) and store.locate(tokens, extra_keys=extra) == [TierKind.DISK] * 4
            for h, key in entered.items():
                i = hashes.index(h)
                assert key == built[i], "the disk got the key the CPU tier was given, whole"
                assert key.parent == (hashes[i - 1] if i else store.seed) and key.tenant != b""
                assert key.extras == (extra.block_extras(i, BLOCK) if events else None)  # KV events ask for extras
            if events:
                persisted = {k.block_hash: k for k in disk.held_keys()}  # what a restarted store announces
                assert persisted == {h: k._replace(tenant=b"") for h, k in entered.items()}  # quotas are per process
                assert reader is not None
                deadline = time.monotonic() + 20
                stored: list[dict[str, Any]] = []
                while time.monotonic() < deadline and sum(len(e["block_hashes"]) for e in stored) < 4:
                    reader.drain(0.3)
                    stored = [e for e in reader.events() if e["type"] == "BlockStored" and e["medium"] == "DISK"]
                by_wire = {wire_hash(h): i for i, h in enumerate(hashes)}
                for e in stored:  # the disk's blocks, announced with the parent and LoRA they were stored under
                    first = by_wire[e["block_hashes"][0]]
                    assert e["parent_block_hash"] == (wire_hash(hashes[first - 1]) if first else None)
                    assert e["lora_name"] == "adapter-1"
                assert sorted(h for e in stored for h in e["block_hashes"]) == sorted(wire_hash(h) for h in entered)
        finally:
            if reader is not None:
                reader.close()


def _replay(changes: Sequence[TierChange]) -> dict[TierKind, set[bytes]]:
    """What a reader following `changes` believes each tier holds; asserts along the way that
    a block leaves a tier only after it entered it."""
    held: dict[TierKind, set[bytes]] = {}
    for c in changes:
        tier = held.setdefault(c.tier, set())
        if c.kind is ChangeKind.ENTERED:
            tier.update(k.block_hash for k in c.keys)
        elif c.kind is ChangeKind.LEFT:
            missing = [k.block_hash for k in c.keys if k.block_hash not in tier]
            assert not missing, f"{c.tier.value}: {len(missing)} blocks left before they entered"
            tier.difference_update(k.block_hash for k in c.keys)
        else:
            tier.clear()
            tier.update(k.block_hash for k in c.keys)
    return held


def _holds(tiers: Sequence[Tier]) -> dict[TierKind, set[bytes]]:
    return {t.kind: set(t.held_hashes()) for t in tiers}


def test_changes_come_in_the_order_they_happened_and_add_up_to_what_tiers_hold(tmp_path: Path) -> None:
    """Pool -> CPU -> disk: a demoted block enters the tier below before it leaves the one
    above (as it happens), every block enters before it leaves, and replaying the changes
    gives exactly what each tier holds, after stores, loads (promotions), a clear and a
    spill on close."""
    config = _config(tmp_path, events=False, pool_blocks=3, pool_device="cpu")
    store = KVCacheStore(config)
    sink = Sink(store)
    for n in range(4):
        tokens = list(range(1000 * n, 1000 * n + 4 * BLOCK))
        store.store(tokens, make_kv(len(tokens), seed=n))
    assert store.retrieve(list(range(4 * BLOCK))).num_tokens == 4 * BLOCK  # promotes disk and CPU hits
    replayed = _replay(sink.changes)
    assert {k: replayed.get(k, set()) for k in _holds(store.tiers)} == _holds(store.tiers)
    # A block evicted from a tier enters the one below before it leaves: never "left the
    # CPU tier, then entered the disk" with nothing of it in between.
    below = {TierKind.POOL: TierKind.CPU, TierKind.CPU: TierKind.DISK}
    order = [(c.tier, c.kind, k.block_hash) for c in sink.changes for k in c.keys]
    demoted = late = 0
    for i, (tier, kind, h) in enumerate(order):
        if kind is not ChangeKind.LEFT or tier not in below:
            continue
        before = [o for o in order[:i] if o[2] == h]
        after = [o for o in order[i + 1:] if o[2] == h]
        demoted += bool(before) and before[-1] == (below[tier], ChangeKind.ENTERED, h)
        late += bool(after) and after[0] == (below[tier], ChangeKind.ENTERED, h)
    assert demoted >= 4 and late == 0, (demoted, late)
    store.clear()
    assert _replay(sink.changes) == {t.kind: set() for t in store.tiers}
    for t in store.tiers:  # each tier's changes end with its clear
        assert [c.kind for c in sink.changes if c.tier == t.kind][-1] is ChangeKind.CLEARED
    tokens = list(range(2 * BLOCK))
    store.store(tokens, make_kv(2 * BLOCK))
    store.close()  # spills the pool and the CPU tier down
    assert set(store.block_hashes(tokens)) <= _replay(sink.changes)[TierKind.DISK]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.mark.parametrize("events", [True, False], ids=["events", "no-events"])
def test_what_the_remote_writer_stored_in_the_background_goes_out(tmp_path: Path, server: RedisServer,
                                                                  events: bool) -> None:
    """The remote tier's writer thread records the blocks the server took; with KV events the
    publisher's own poll hands them out with no further call, without them `flush()` does."""
    with KVCacheStore(_config(tmp_path, events=events, remote_url=server.url, cpu_blocks=8)) as store:
        sink = Sink(store)
        tokens = list(range(4 * BLOCK))
        store.store(tokens, make_kv(len(tokens)))
        want = set(store.block_hashes(tokens))
        if events:
            deadline = time.monotonic() + 20  # no call to the store meanwhile: the publisher pulls
            while time.monotonic() < deadline and {k.block_hash for k in
                                                   sink.keys(TierKind.REMOTE, ChangeKind.ENTERED)} != want:
                time.sleep(0.05)
        else:
            assert store.flush()
        remote = sink.keys(TierKind.REMOTE, ChangeKind.ENTERED)
        assert {k.block_hash for k in remote} == want
        assert all(k.parent is not None and k.tokens for k in remote), "whole keys, not bare hashes"


def test_no_tier_or_keyer_holds_code_from_above(tmp_path: Path, server: RedisServer) -> None:
    """Nothing a tier (or the keyer) holds is code of the store, the event service or an
    engine: tiers call only down (`below`, the stack's view of the next tier) and into their
    own helpers. Walks every object a tier reaches through its attributes."""
    from kvstore.keying import Keyer

    above = ("kvstore", "kvevents", "engine_adapter", "router", "cli")

    def owner(value: object) -> str:
        target = getattr(value, "__self__", None)
        if target is not None:  # a bound method: whose
            return type(target).__module__
        return getattr(value, "__module__", None) or type(value).__module__

    config = _config(tmp_path, events=True, pool_blocks=4, pool_device="cpu", remote_url=server.url)
    with KVCacheStore(config) as store:
        store.store(list(range(8 * BLOCK)), make_kv(8 * BLOCK))
        found: list[str] = []
        seen: set[int] = set()

        def walk(obj: object, path: str, depth: int) -> None:
            if id(obj) in seen or depth > 4:
                return
            seen.add(id(obj))
            items = (list(vars(obj).items()) if hasattr(obj, "__dict__") else
                     [(s, getattr(obj, s)) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)])
            for name, value in items:
                if name == "below":  # the stack's downward view: what a tier demotes into
                    continue
                if callable(value) and not isinstance(value, type) and owner(value).startswith(above):
                    found.append(f"{path}.{name} -> {owner(value)}")
                if isinstance(value, (list, tuple)):
                    for i, v in enumerate(value[:4]):
                        walk(v, f"{path}.{name}[{i}]", depth + 1)
                elif type(value).__module__.startswith("tiers."):
                    walk(value, f"{path}.{name}", depth + 1)

        for tier in store.tiers:
            assert not hasattr(tier, "listener") and not hasattr(tier, "describe")
            walk(tier, tier.kind.value, 0)
        assert isinstance(store._keyer, Keyer)
        assert not [n for n, v in vars(store._keyer).items() if callable(v)], "the keyer is pure"
        assert found == [], found
