"""The engine API (`kvstore/engine_api.py`, over the tier stack in `kvstore/block_store.py`):
block-keyed lookup, load, save, prefetch and events, under an engine's own keys (no tokens,
or tokens to verify) and under kvstrata's chain keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore import BlockChange, HashAlgo, InvalidInputError, KVCacheStore, LayoutMismatchError, StoreConfig
from kvstore.block_events import EventLog
from kvstore.hashing import engine_block_hash, namespace_seed
from kvstore.keying import Keyer
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.changes import ChangeKind, TierChange
from tiers.keys import BlockKey, TierKind

Factory = Callable[..., KVCacheStore]
PAGES = [f"sglang-page-{i:02d}" for i in range(6)]  # an engine's own page keys: no tokens


def _blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = make_kv(n * BLOCK, seed)
    return [kv[:, :, i * BLOCK : (i + 1) * BLOCK].clone() for i in range(n)]


def _empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype) for _ in range(n)]


def test_engine_keyed_blocks_round_trip_without_tokens(make_store: Factory) -> None:
    store = make_store()
    blocks = _blocks(6, seed=1)
    keys = store.engine_keys(PAGES)
    assert store.blocks.lookup(keys).num_blocks == 0
    assert store.blocks.save(keys, blocks) == (6, 6)
    assert store.blocks.save(keys[:2], blocks[:2]) == (0, 2)  # already held: only touched
    found = store.blocks.lookup(keys)
    assert found.tiers == [TierKind.CPU] * 6 and found.blocks_per_tier == {TierKind.CPU: 6}
    dsts = _empty(6)
    assert store.blocks.load(keys, dsts) == (6, {TierKind.CPU: 6})
    assert all(torch.equal(d, b) for d, b in zip(dsts, blocks, strict=True))
    assert store.blocks.lookup(store.engine_keys(["another page"])).num_blocks == 0
    store.check_integrity()


def test_engine_keys_are_pure_and_pinned() -> None:
    """Golden vectors: `H(version tag || namespace seed || engine key)`, text as UTF-8."""
    golden = namespace_seed("golden")
    assert engine_block_hash(golden, b"page-0", HashAlgo.XXH3_128).hex() == "f00812d065bcd47a79085a5f6aef430f"
    assert engine_block_hash(golden, "page-0", HashAlgo.XXH3_128) == engine_block_hash(golden, b"page-0",
                                                                                        HashAlgo.XXH3_128)
    sha = engine_block_hash(namespace_seed("golden", "sha256"), "page-0", HashAlgo.SHA256)
    assert sha.hex() == "c1a2b74eb4f6e676e55731995da230588d2668080f2affa5ad488b540dab0823"
    for bad in (b"", "", 7, None, b"x" * 4097):
        with pytest.raises(InvalidInputError, match="engine block key"):
            engine_block_hash(golden, bad, HashAlgo.XXH3_128)


def test_engine_keys_with_tokens_are_verified_on_every_hit(make_store: Factory) -> None:
    store = make_store(disk=False)
    tokens = [list(range(i * BLOCK, (i + 1) * BLOCK)) for i in range(3)]
    blocks = _blocks(3, seed=2)
    store.blocks.save(store.engine_keys(PAGES[:3], tokens), blocks)
    dsts = _empty(3)
    assert store.blocks.load(store.engine_keys(PAGES[:3], tokens), dsts).num_blocks == 3
    assert store.blocks.load(store.engine_keys(PAGES[:3]), _empty(3)).num_blocks == 3  # nothing to check
    wrong = [tokens[0], [9, 9, 9, 9], tokens[2]]  # the engine's key, other tokens: a miss from there
    dsts = _empty(3)
    assert store.blocks.load(store.engine_keys(PAGES[:3], wrong), dsts).num_blocks == 1
    assert torch.equal(dsts[0], blocks[0]) and not dsts[1].any() and not dsts[2].any()
    with pytest.raises(LayoutMismatchError, match="tokens\\[1\\] holds 3 token ids; a block holds 4"):
        store.engine_keys(PAGES[:2], [tokens[0], [1, 2, 3]])
    with pytest.raises(InvalidInputError, match="one block of token ids"):
        store.engine_keys(PAGES[:2], [tokens[0]])


def test_two_namespaces_never_share_an_engine_keyed_entry(make_store: Factory) -> None:
    """One disk directory, one engine key, two models: each sees only its own block."""
    a = make_store(namespace="model-a", write_through=True)
    b = make_store(namespace="model-b", write_through=True)
    again = make_store(namespace="model-a", cpu_blocks=0)  # model-a's second process: disk only
    assert a.engine_keys(PAGES)[0] != b.engine_keys(PAGES)[0]
    block_a, block_b = _blocks(1, seed=3)[0], _blocks(1, seed=4)[0]
    a.blocks.save(a.engine_keys(PAGES[:1]), [block_a])
    assert b.blocks.lookup(b.engine_keys(PAGES[:1])).num_blocks == 0
    dst = _empty(1)
    assert again.blocks.load(again.engine_keys(PAGES[:1]), dst) == (1, {TierKind.DISK: 1})  # shared disk
    assert torch.equal(dst[0], block_a)
    b.blocks.save(b.engine_keys(PAGES[:1]), [block_b])
    assert a.blocks.load(a.engine_keys(PAGES[:1]), dst).num_blocks == 1 and torch.equal(dst[0], block_a)
    assert b.blocks.load(b.engine_keys(PAGES[:1]), dst).num_blocks == 1 and torch.equal(dst[0], block_b)


def test_a_load_stops_at_the_first_missing_block_and_leaves_no_hole(make_store: Factory) -> None:
    store = make_store()
    blocks = _blocks(4, seed=5)
    keys = store.engine_keys(PAGES[:4])
    store.blocks.save([keys[0], keys[1], keys[3]], [blocks[0], blocks[1], blocks[3]])  # page 2 missing
    dsts = _empty(4)
    assert store.blocks.lookup(keys).num_blocks == 2
    assert store.blocks.load(keys, dsts) == (2, {TierKind.CPU: 2})
    assert torch.equal(dsts[1], blocks[1]) and not dsts[2].any() and not dsts[3].any()  # past the miss: untouched
    sized: list[int] = []

    def allocate(n: int) -> list[torch.Tensor]:  # destinations sized by the hit
        sized.append(n)
        return _empty(n)

    assert store.blocks.load(keys, allocate).num_blocks == 2 and sized == [2]
    assert store.blocks.load(store.engine_keys(["nothing"]), allocate).num_blocks == 0 and sized == [2]


def test_chain_keys_and_the_token_api_meet_in_one_store(make_store: Factory) -> None:
    """Keys from kvstrata's chain reach the blocks `store` wrote; a lookup builds no key."""
    store = make_store()
    tokens = list(range(100, 100 + 5 * BLOCK + 1))
    kv = make_kv(len(tokens), seed=6)
    assert store.store(tokens, kv) == 5 * BLOCK
    keys = store.keys(tokens, first_block=2)
    assert [k.block_hash for k in keys] == store.block_hashes(tokens)[2:]
    assert store.blocks.lookup(keys).num_blocks == 3
    dsts = _empty(3)
    assert store.blocks.load(keys, dsts).num_blocks == 3
    assert torch.equal(torch.cat(dsts, dim=2), kv[:, :, 2 * BLOCK : 5 * BLOCK])
    built: list[int] = []
    original = Keyer.build_keys

    def counting(self: Keyer, *args: object, **kwargs: object) -> list[BlockKey]:
        result = original(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(len(result))
        return result

    Keyer.build_keys = counting  # type: ignore[method-assign]
    try:
        assert store.lookup(tokens) == 5 * BLOCK and store.blocks.lookup(store.keys(tokens)[1:]).num_blocks == 4
        assert built == []  # hashes alone
        store.blocks.load(store.keys(tokens, num_blocks=2), _empty(2))
        assert built == [2]
    finally:
        Keyer.build_keys = original  # type: ignore[method-assign]
    with pytest.raises(LayoutMismatchError, match=r"blocks 3\.\.5 need 24 tokens, got 21"):
        store.keys(tokens, first_block=3, num_blocks=3)


def test_bad_keys_and_tensors_raise_one_error_and_change_nothing(make_store: Factory) -> None:
    store = make_store()
    blocks = _blocks(2, seed=7)
    keys = store.engine_keys(PAGES[:2])
    for bad in ("page", [b"raw-hash"], [BlockKey(b"")], 3):
        with pytest.raises(InvalidInputError, match="block key"):
            store.blocks.save(bad, blocks)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="block key"):
            store.blocks.lookup(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="2 block keys but 1 block tensors"):
        store.blocks.save(keys, blocks[:1])
    with pytest.raises(InvalidInputError, match="overlap"):
        store.blocks.load(keys, [blocks[0], blocks[0]])
    with pytest.raises(InvalidInputError, match="engine block ids must be a sequence"):
        store.engine_keys("page")
    assert store.stats().num_blocks_stored == 0 and store.blocks.lookup(keys).num_blocks == 0


def test_prefetch_brings_engine_keyed_blocks_from_disk_into_memory(make_store: Factory) -> None:
    store = make_store(cpu_blocks=4)
    keys = store.engine_keys(PAGES)
    store.blocks.save(keys, _blocks(6, seed=8))  # 6 blocks into 4 CPU slots: the tail goes to disk
    assert store.blocks.lookup(keys).tiers == [TierKind.CPU] * 4 + [TierKind.DISK] * 2
    assert store.blocks.prefetch(keys[4:]).result(timeout=30).num_in_memory == 2
    assert store.blocks.lookup(keys[4:]).tiers == [TierKind.CPU] * 2
    assert store.prefetched_blocks == {TierKind.DISK: 2}


def test_take_events_drains_the_changes_since_the_last_call(make_store: Factory) -> None:
    store = make_store(cpu_blocks=2, disk=False)
    keys = store.engine_keys(PAGES[:3])
    store.blocks.save(keys[:1], _blocks(1, seed=9))
    assert store.blocks.take_events() == ([], 0)  # recording starts with the first call
    store.blocks.save(keys[1:], _blocks(2, seed=10))  # a third block in two slots: one evicted
    events = store.blocks.take_events()
    assert events.num_dropped == 0
    stored = [h for e in events.events if e.change is BlockChange.STORED for h in e.block_hashes]
    removed = [h for e in events.events if e.change is BlockChange.REMOVED for h in e.block_hashes]
    assert sorted(stored) == sorted(k.block_hash for k in keys[1:]) and removed == [keys[0].block_hash]
    assert {e.tier for e in events.events} == {TierKind.CPU}
    assert store.blocks.take_events() == ([], 0)  # drained
    store.clear()
    last = store.blocks.take_events().events[-1]
    assert (last.change, last.tier, last.block_hashes) == (BlockChange.CLEARED, TierKind.CPU, ())


def test_the_event_buffer_is_bounded_and_says_what_it_dropped() -> None:
    log = EventLog(max_blocks=4)

    def change(tier: TierKind, kind: ChangeKind, ids: range | list[bytes]) -> TierChange:
        return TierChange(tier, kind, [BlockKey(bytes([i]) if isinstance(i, int) else i) for i in ids])

    log.on_changes([change(TierKind.CPU, ChangeKind.ENTERED, range(3))])
    log.on_changes([change(TierKind.CPU, ChangeKind.LEFT, [b"x", b"y"])])  # the first 3 make room for these
    log.on_changes([change(TierKind.DISK, ChangeKind.CLEARED, [])])
    taken = log.take()
    assert [e.change for e in taken.events] == [BlockChange.REMOVED, BlockChange.CLEARED] and taken.num_dropped == 3
    log.on_changes([change(TierKind.CPU, ChangeKind.ENTERED, range(5))])  # larger than the buffer
    assert log.take() == ([], 5) and log.take() == ([], 0)
    log.on_changes([change(TierKind.CPU, ChangeKind.RESYNC, range(2))])  # a tier restated: cleared, then held
    assert [(e.change, len(e.block_hashes)) for e in log.take().events] == [(BlockChange.CLEARED, 0),
                                                                           (BlockChange.STORED, 2)]


def test_a_retrieve_is_timed_once_under_its_own_name(make_store: Factory) -> None:
    store = make_store()
    seen: list[str] = []
    store.observe_latency = lambda op, seconds: seen.append(op)
    tokens = list(range(3 * BLOCK))
    store.store(tokens, make_kv(len(tokens)))
    store.retrieve(tokens)
    store.blocks.load(store.keys(tokens), _empty(3))
    assert seen == ["store", "retrieve", "load"]


def test_engine_keys_follow_verify_tokens(tmp_path: Path) -> None:
    config = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=4 * LAYOUT.block_bytes(BLOCK), verify_tokens=False)
    with KVCacheStore(config) as store:
        key = store.engine_keys(PAGES[:1], [[1, 2, 3, 4]])[0]
        assert key.tokens == b""  # a store that keeps no token ids checks none
