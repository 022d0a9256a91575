"""The connector's handling of several KV cache groups and shards, without vLLM: which blocks
each kind of attention keeps, the plans that follow, hits across groups and shards over real
stores, and the worker that splits a step between groups over real paged tensors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine_adapter.vllm.group_lookup import GroupLookup
from engine_adapter.vllm.group_worker import GroupedWorker
from engine_adapter.vllm.groups import NULL_BLOCK_ID, GroupKind, GroupRule
from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.store_config import GroupStore
from engine_adapter.vllm.transfer_plan import BlockTransfer, GroupBlocks, StepPlan, TransferPlanner
from kvstore import ConfigError, ExtraKeys, KVCacheStore, StoreConfig

B = 4  # tokens per block in these tests
FULL = GroupRule(GroupKind.FULL, B)
WINDOW = GroupRule(GroupKind.WINDOW, B, span=8)  # the next token reads the 7 before it: 2 blocks
CHUNKED = GroupRule(GroupKind.CHUNKED, B, span=8)  # chunks of 2 blocks
STATE = GroupRule(GroupKind.STATE, B)

# -- what each kind of group needs -----------------------------------------------------------


def test_a_hit_needs_the_prefix_the_window_the_chunk_or_the_state() -> None:
    assert FULL.needed(5) == range(0, 5)
    assert WINDOW.needed(5) == range(3, 5)
    assert WINDOW.needed(1) == range(0, 1)
    assert GroupRule(GroupKind.WINDOW, B, span=9).needed(5) == range(3, 5)  # 8 tokens back: still 2 blocks
    assert GroupRule(GroupKind.WINDOW, B, span=10).needed(5) == range(2, 5)  # 9 tokens back: 3 blocks
    assert GroupRule(GroupKind.WINDOW, B, span=1).needed(5) == range(5, 5)  # attends to itself only
    assert CHUNKED.needed(5) == range(4, 5)  # position 20 is in the chunk [16, 24): it reads block 4
    assert CHUNKED.needed(4) == range(4, 4)  # position 16 opens a chunk: nothing before it is read
    assert CHUNKED.needed(6) == range(6, 6) and CHUNKED.needed(7) == range(6, 7)
    assert STATE.needed(5) == range(4, 5)
    for rule in (FULL, WINDOW, CHUNKED, STATE):
        assert rule.needed(0) == range(0)


def test_only_blocks_a_hit_would_need_are_saved_and_never_the_null_block() -> None:
    # After a step ending at token 21 with 5 blocks complete:
    assert FULL.savable(0, 7, 5, 21)
    assert not WINDOW.savable(2, 7, 5, 21) and WINDOW.savable(3, 7, 5, 21)  # outside / inside the window
    assert not WINDOW.savable(4, NULL_BLOCK_ID, 5, 21)  # vLLM no longer holds it
    assert not STATE.savable(4, 7, 5, 21)  # the state there is the state after token 21, not 20
    assert STATE.savable(4, 7, 5, 20) and not STATE.savable(3, 7, 5, 20)


def test_group_rules_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="block size must be positive"):
        GroupRule(GroupKind.FULL, 0)
    with pytest.raises(ConfigError, match="window group needs a positive span"):
        GroupRule(GroupKind.WINDOW, B)


# -- plans over several groups ---------------------------------------------------------------------


def test_planner_loads_and_saves_each_groups_own_blocks() -> None:
    planner = TransferPlanner(B, lambda tokens, keys: 8 * B, [FULL, WINDOW, STATE])
    tokens = list(range(100, 141))  # 41 tokens: 10 full blocks
    assert planner.num_new_matched_tokens("r", tokens, num_computed=2 * B) == 6 * B
    planner.on_alloc("r", tokens, 6 * B)
    # vLLM's tables: full attention holds all; the window group nulls what its window left
    # behind; the state group holds states at the last boundaries only.
    ids = [list(range(10, 21)), [0] * 6 + [36, 37, 38, 39, 40], [0] * 7 + [57, 58, 59, 60]]
    plan = planner.build([("r", 8 * B, 8)], lambda _: ids)  # computes tokens [32, 40)
    (load,) = plan.loads
    assert load.groups == (GroupBlocks(2, tuple(range(12, 18))), GroupBlocks(6, (36, 37)), GroupBlocks(7, (57,)))
    (save,) = plan.saves
    assert save.groups == (GroupBlocks(8, (18, 19)), GroupBlocks(8, (38, 39)), GroupBlocks(9, (59,)))
    assert len(save.token_ids) == 10 * B
    # The next step ends mid-block: the full and window groups have nothing new, and no state
    # is saved (the state in block 10 is not the state at its boundary).
    assert planner.build([("r", 40, 1)], lambda _: ids).saves == []


def test_a_state_is_saved_only_at_a_step_that_ends_on_its_boundary() -> None:
    planner = TransferPlanner(B, lambda tokens, keys: 0, [FULL, STATE])
    tokens = list(range(30))
    planner.num_new_matched_tokens("r", tokens, 0)
    planner.on_alloc("r", tokens, 0)
    ids = [list(range(1, 9)), list(range(11, 19))]
    (save,) = planner.build([("r", 0, 14)], lambda _: ids).saves  # ends at 14: blocks 0-2 done
    assert save.groups == (GroupBlocks(0, (1, 2, 3)), GroupBlocks(3, ()))
    (save,) = planner.build([("r", 14, 2)], lambda _: ids).saves  # ends at 16, on block 3's boundary
    assert save.groups == (GroupBlocks(3, (4,)), GroupBlocks(3, (14,)))


def test_vllms_second_alloc_after_a_background_load_keeps_the_requests_keys() -> None:
    """vLLM calls `update_state_after_alloc` again, with nothing to load, once a background
    load has ended. The request must keep its isolation keys: before, it was tracked anew
    with none, and its blocks were saved again under keys that any tenant could hit."""
    salt = ExtraKeys(cache_salt="tenant-A")
    planner = TransferPlanner(B, lambda tokens, keys: 2 * B)
    tokens = list(range(20))
    planner.num_new_matched_tokens("r", tokens, 0, salt)
    planner.on_alloc("r", tokens, 2 * B)
    assert planner.take_load("r", [[5, 6, 7, 8, 9]]) is not None  # the background load
    planner.on_alloc("r", tokens, 0)  # vLLM, once the load has ended
    (save,) = planner.build([("r", 2 * B, 12)], lambda _: [[5, 6, 7, 8, 9]]).saves
    assert save.extra_keys == salt
    assert save.groups == (GroupBlocks(2, (7, 8, 9)),)  # the loaded blocks are not saved again


@pytest.mark.parametrize("verify", [False, True])
def test_a_requests_priority_hint_rides_on_each_of_its_saves(verify: bool) -> None:
    planner = TransferPlanner(B, lambda tokens, keys: 2 * B if verify else 0)
    tokens = list(range(20))
    planner.num_new_matched_tokens("r", tokens, 0, priority="low", retain_s=5.0)
    if verify:
        planner.verify("r")  # the hint survives the verify path's rewrite of the lookup
    planner.on_alloc("r", tokens, 0)
    first = planner.build([("r", 0, 8)], lambda _: [[1, 2, 3, 4, 5]]).saves
    second = planner.build([("r", 8, 12)], lambda _: [[1, 2, 3, 4, 5]]).saves
    assert [(s.priority, s.retain_s, s.verify) for s in first + second] == [("low", 5.0, verify)] * 2


def test_a_request_never_looked_up_is_never_saved() -> None:
    planner = TransferPlanner(B, lambda tokens, keys: 0)
    planner.on_alloc("r", list(range(20)), 0)
    assert planner.build([("r", 0, 20)], lambda _: [[1, 2, 3, 4, 5]]).saves == []


# -- hits across groups and shards, over real stores ------------------------------------------------


@pytest.fixture
def make_group_store() -> Iterator[object]:
    made: list[KVCacheStore] = []

    def make(name: str) -> KVCacheStore:
        store = KVCacheStore(StoreConfig(layout=opaque_layout(1, 64, B), block_size=B, cpu_bytes=1 << 20,
                                         namespace=name))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def _put(store: KVCacheStore, tokens: list[int], blocks: list[int], value: int = 1) -> None:
    block = torch.full(store.config.block_shape, value, dtype=torch.uint8)
    for i in blocks:
        store.blocks.save(store.keys(tokens[: (i + 1) * B], first_block=i), [block])


def test_a_hit_is_the_longest_prefix_every_group_and_shard_can_serve(make_group_store) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(200, 241))  # 10 full blocks
    full = [make_group_store("full-shard0"), make_group_store("full-shard1")]
    window, state = make_group_store("window"), make_group_store("state")
    lookup = GroupLookup([FULL, WINDOW, STATE], [full, [window], [state]], primary=0)
    _put(full[0], tokens, list(range(10)))
    _put(full[1], tokens, list(range(8)))  # the other shard has less: 8 is the limit
    _put(window, tokens, [6, 7])
    _put(state, tokens, [5])
    assert lookup.locate(tokens, None) == []  # no state at 8, nor a window at 6
    _put(state, tokens, [7])
    assert len(lookup.locate(tokens, None)) == 8
    assert lookup.cut(7) == 0  # no length below 8 is servable
    _put(window, tokens, [3, 4])
    _put(state, tokens, [4])
    lookup.locate(tokens, None)
    assert lookup.cut(7) == 5  # window [3, 5) and the state at 5
    assert len(lookup.locate(tokens, ExtraKeys(cache_salt="other"))) == 0  # other keys: other blocks


# -- the worker over several groups, over real stores and paged tensors ----------------------------------


def _worker(stores: list[KVCacheStore], layers: dict[str, torch.Tensor]) -> GroupedWorker:
    specs = [GroupStore(g, rule, store.config, (f"l{g}",), writer=True)
             for g, (rule, store) in enumerate(zip([FULL, WINDOW], stores))]
    worker = GroupedWorker(list(zip(specs, stores)), 0, 8, ConnectorStats("worker", None), async_saves=False,
                           fail_whole_requests=True)
    worker.register_kv_caches(layers)
    return worker


def test_grouped_worker_saves_and_loads_each_groups_blocks(make_group_store) -> None:  # type: ignore[no-untyped-def]
    tokens = np.arange(300, 324, dtype=np.uint32)  # 6 blocks
    stores = [make_group_store("g0"), make_group_store("g1")]
    src = {"l0": torch.arange(8 * 64, dtype=torch.int32).view(8, 64).to(torch.uint8),
           "l1": (torch.arange(8 * 64, dtype=torch.int32).view(8, 64) * 7).to(torch.uint8)}
    writer = _worker(stores, src)
    save = BlockTransfer("r", tokens, (GroupBlocks(0, (1, 2, 3, 4, 5, 6)), GroupBlocks(4, (3, 7))))
    writer.save(StepPlan(saves=[save]))
    assert len(stores[0].locate(tokens)) == 6 and len(stores[1].locate(tokens)) == 0  # group 1: blocks 4, 5 only
    dst = {"l0": torch.zeros(8, 64, dtype=torch.uint8), "l1": torch.zeros(8, 64, dtype=torch.uint8)}
    reader = _worker(stores, dst)
    load = BlockTransfer("q", tokens, (GroupBlocks(2, (5, 6, 7, 1)), GroupBlocks(4, (2, 4))))
    reader.load(StepPlan(loads=[load]))
    assert torch.equal(dst["l0"][[5, 6, 7, 1]], src["l0"][[3, 4, 5, 6]])
    assert torch.equal(dst["l1"][[2, 4]], src["l1"][[3, 7]])
    assert not dst["l0"][[0, 2, 3, 4]].any() and not dst["l1"][[0, 1, 3, 5, 6, 7]].any()
    writer.flush()
    reader.flush()


def test_background_loads_end_once_every_group_did_and_failures_fail_the_request(make_group_store) -> None:  # type: ignore[no-untyped-def]
    tokens = np.arange(400, 416, dtype=np.uint32)  # 4 blocks
    stores = [make_group_store("h0"), make_group_store("h1")]
    _put(stores[0], list(tokens), [0, 1, 2, 3])
    _put(stores[1], list(tokens), [2])  # block 3 of group 1 is missing: its load fails
    layers = {"l0": torch.zeros(8, 64, dtype=torch.uint8), "l1": torch.zeros(8, 64, dtype=torch.uint8)}
    worker = _worker(stores, layers)
    gate = threading.Event()
    slow_worker = worker.workers[1]
    original = slow_worker._load_one

    def held_back(*args: object, **kwargs: object) -> None:
        gate.wait(10)
        original(*args, **kwargs)  # type: ignore[arg-type]

    slow_worker._load_one = held_back  # type: ignore[method-assign]
    ok = BlockTransfer("ok", tokens, (GroupBlocks(0, (1, 2, 3, 4)), GroupBlocks(4, ())))
    bad = BlockTransfer("bad", tokens, (GroupBlocks(0, (1, 2, 3, 4)), GroupBlocks(2, (5, 6))))
    worker.load(StepPlan(async_loads=[ok, bad]))
    worker.workers[0].wait_for_loads(10)  # group 0's loads ended
    assert worker.get_finished(set()) == (None, None)  # group 1's have not
    gate.set()
    slow_worker.wait_for_loads(10)
    _, recving = worker.get_finished(set())
    assert recving == {"ok", "bad"}
    assert worker.take_failed_loads(recving) == {"bad"}
    assert worker.take_load_errors() == set()  # several groups: vLLM takes no block ids
    assert (layers["l1"][5] == 1).all() and not layers["l1"][6].any()
    worker.flush()


def test_a_prompt_filling_its_last_block_keeps_the_window_its_repeat_needs() -> None:
    """A repeated prompt hits at most up to the block before its last token. When the prompt
    fills its last block, that is one block short of where the prompt ended: the window
    before that point is kept too (before, only the window before the prompt's end was, and
    a repeat of a 512-token prompt never hit a windowed model)."""
    planner = TransferPlanner(B, lambda tokens, keys: 0, [FULL, WINDOW])
    tokens = list(range(24))  # exactly 6 blocks: a repeat hits at most 5
    planner.num_new_matched_tokens("r", tokens, 0)
    planner.on_alloc("r", tokens, 0)
    ids = [list(range(1, 7)), [0, 0, 0, 14, 15, 16]]
    (save,) = planner.build([("r", 0, 24)], lambda _: ids).saves
    assert save.groups[1] == GroupBlocks(3, (14, 15, 16))  # [4, 6) for a hit of 6; [3, 5) for 5


# -- tensor-parallel shards and the pipeline-stage manifest -----------------------------------------


def test_ranks_holding_the_same_bytes_form_one_shard_written_by_its_first_rank() -> None:
    from types import SimpleNamespace

    from engine_adapter.vllm.parallel import Place, Shard, shard_of

    mla = SimpleNamespace(max_tp_shards=1)  # the latent: the same on every rank
    assert [shard_of(mla, Place(2, r, 1, 0)) for r in range(2)] == [Shard(2, 1, 0, True), Shard(2, 1, 0, False)]
    gqa = SimpleNamespace(max_tp_shards=2)  # 2 KV heads over 4 ranks: pairs hold the same head
    assert [(s.shard, s.writer) for s in (shard_of(gqa, Place(4, r, 1, 0)) for r in range(4))] == [
        (0, True), (0, False), (1, True), (1, False)]
    state = SimpleNamespace()  # no claim: every rank its own
    assert [shard_of(state, Place(2, r, 1, 0)).shard for r in range(2)] == [0, 1]
    assert shard_of(mla, Place(1, 0, 1, 0)).identity() is None  # no tensor parallelism: nothing in the key
    assert shard_of(mla, Place(2, 1, 1, 0)).identity() == {"tp": 2, "shards": 1, "shard": 0}


def test_stage_manifests_round_trip_and_a_missing_one_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.vllm.parallel import Place, publish_layers, read_layers

    deployment = {"model": "m", "parallel": [1, 2]}
    stage1 = Place(1, 0, 2, 1)
    publish_layers(str(tmp_path), deployment, stage1, [["model.layers.1.attn"], []])
    assert read_layers(str(tmp_path), deployment, stage1, 2) == [["model.layers.1.attn"], []]
    with pytest.raises(ConfigError, match=r"pipeline stage 0 \(tensor rank 0\) did not publish its layers"):
        read_layers(str(tmp_path), deployment, Place(1, 0, 2, 0), 2)
    with pytest.raises(ConfigError, match="did not publish"):  # another deployment's manifest is not this one's
        read_layers(str(tmp_path), {**deployment, "model": "other"}, stage1, 2)
    with pytest.raises(ConfigError, match="malformed"):
        read_layers(str(tmp_path), deployment, stage1, 3)


def test_a_chunked_group_keeps_the_chunk_a_repeat_needs_even_when_the_prompt_ends_a_chunk() -> None:
    """A prompt ending on a chunk boundary needs nothing of the chunked group for a hit of all
    its blocks, but its repeat hits one block shorter, inside the last chunk: that chunk's
    first block is kept (before, only a run ending at the prompt's end was: nothing)."""
    planner = TransferPlanner(B, lambda tokens, keys: 0, [FULL, CHUNKED])
    tokens = list(range(32))  # 8 blocks, 4 chunks of 2: a repeat hits at most 7 blocks
    planner.num_new_matched_tokens("r", tokens, 0)
    planner.on_alloc("r", tokens, 0)
    ids = [list(range(1, 9)), [0, 0, 0, 0, 0, 0, 17, 18]]
    (save,) = planner.build([("r", 0, 32)], lambda _: ids).saves
    assert save.groups[1] == GroupBlocks(6, (17,))  # block 6: the chunk [24, 32) before token 28
