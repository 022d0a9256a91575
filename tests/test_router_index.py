"""The router's pure parts: the block index, the fleet view's resync logic, the mapping of
vLLM's GPU events onto kvstrata keys, and the scoring."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.events import EventSource
from kvstore.hashing import ExtraKeys, block_hashes
from kvstore.router.fleet import FleetView
from kvstore.router.index import KVIndex, block_key
from kvstore.router.lookup import BadRequest, Chooser, Scoring, parse_query

BS = 4
SEED_NS = ["model-x", 4]


def _source(instance_id: str, epoch: int = 1, remote: str | None = None) -> EventSource:
    from kvstore.hashing import namespace_seed

    return EventSource(instance_id, "model-x", bytes(namespace_seed(SEED_NS)), "xxh3_128", BS, remote, epoch)


def _hashes(tokens: list[int], extra: ExtraKeys | None = None) -> list[bytes]:
    return [bytes(h) for h in block_hashes(tokens, BS, namespace=SEED_NS, extra_keys=extra)]


def _batch(src: EventSource, *events: list[Any]) -> dict[str, Any]:
    return msgpack.unpackb(msgpack.packb({"v": 1, "src": src.to_wire(), "ev": list(events)}))  # type: ignore[no-any-return]


def _snapshot(src: EventSource, **tiers: list[bytes]) -> dict[str, Any]:
    return {"v": 1, "src": src.to_wire(), "tiers": {t: b"".join(hs) for t, hs in tiers.items()}}


def test_index_tracks_tiers_per_slot_and_matches_the_fastest() -> None:
    index = KVIndex()
    keys = [block_key(bytes([i]) * 16) for i in range(1, 6)]
    index.add(0, 1, keys[:4])  # slot 0: cpu
    index.add(0, 0, keys[:2])  # and pool for the first two
    index.add(1, 2, keys)  # slot 1: disk
    assert index.match(keys, [(0, None), (1, None)]) == [[2, 2, 0, 0], [0, 0, 5, 0]]
    index.remove(1, 2, keys[2:3])  # a hole ends slot 1's prefix
    assert index.match(keys, [(1, None)]) == [[0, 0, 2, 0]]
    index.add(2, 3, keys)  # a remote slot read by slot 1 fills the hole
    assert index.match(keys, [(1, 2)]) == [[0, 0, 4, 1]]
    index.clear(0)
    index.clear(1)
    index.clear(2)
    assert len(index) == 0


def test_gap_and_restart_trigger_a_snapshot_and_replay() -> None:
    fleet = FleetView()
    a = _source("a")
    doc = _hashes(list(range(16)))
    assert fleet.on_batch(1, _batch(a), "tcp://x:1", now=0) is not None  # unknown: ask for a snapshot
    # batches 2 and 3 arrive while the snapshot (taken at batch 2) is on its way
    assert fleet.on_batch(2, _batch(a, ["stored", "cpu", b"".join(doc[:2])]), now=0) is None
    assert fleet.on_batch(3, _batch(a, ["stored", "cpu", b"".join(doc[2:])]), now=0) is None
    assert fleet.apply_snapshot(2, _snapshot(a, cpu=doc[:2]))
    inst = fleet.instances["a"]
    assert inst.synced and inst.seq == 3
    tokens = np.arange(16, dtype="<u4")
    assert fleet.match(tokens, None, [inst]) == {"a": [0, 4, 0, 0]}
    # a gap: unsynced until the next snapshot, which replaces the blocks
    assert fleet.on_batch(5, _batch(a, ["removed", "cpu", b"".join(doc)]), now=0) is not None
    assert not inst.synced
    assert fleet.apply_snapshot(5, _snapshot(a, disk=doc[:1]))
    assert fleet.match(tokens, None, [inst]) == {"a": [0, 0, 1, 0]}
    # a restart (new epoch) forgets the old blocks at once
    assert fleet.on_batch(1, _batch(_source("a", epoch=2)), now=0) is not None
    assert fleet.match(tokens, None, [fleet.instances["a"]]) == {"a": [0, 0, 0, 0]}
    # malformed messages are counted, never raised
    fleet.on_batch(1, {"src": {"id": 1}}, now=0)
    assert fleet.apply_snapshot(1, _snapshot(_source("a", epoch=2)))
    fleet.on_batch(2, _batch(_source("a", epoch=2), ["stored", "cpu", b"xyz"], ["bogus"]), now=0)
    assert fleet.num_bad_messages == 3


def _vllm_stored(hashes: list[object], parent: object, tokens: list[int], extra: list[Any] | None = None,
                 lora_name: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": lora_name, "extra_keys": extra}


def test_vllm_gpu_events_map_onto_kvstrata_keys() -> None:
    fleet = FleetView()
    a = _source("a")
    fleet.on_batch(1, _batch(a), "tcp://x:1", now=0)
    fleet.apply_snapshot(1, _snapshot(a))
    inst = fleet.instances["a"]
    tokens = list(range(100, 124))  # 6 blocks, stored by vLLM in two steps
    fleet.on_vllm_batch("a", [0.0, [_vllm_stored([11, 12, 13], None, tokens[:12])]])
    fleet.on_vllm_batch("a", [0.0, [_vllm_stored([14, 15, 16], 13, tokens[12:])]])
    arr = np.asarray(tokens, dtype="<u4")
    assert fleet.match(arr, None, [inst]) == {"a": [6, 0, 0, 0]}
    # the mapped keys are exactly the store's: one more kvstrata block extends the prefix
    fleet.on_batch(2, _batch(a, ["stored", "disk", _hashes([*tokens, 1, 2, 3, 4])[6]]), now=0)
    assert fleet.match(np.asarray([*tokens, 1, 2, 3, 4], dtype="<u4"), None, [inst]) == {"a": [6, 0, 1, 0]}
    # a salted sequence maps with the salt on its first block only
    fleet.on_vllm_batch("a", [0.0, [_vllm_stored([21, 22], None, tokens[:8], extra=[["tenant"], None])]])
    assert fleet.match(arr, ExtraKeys(cache_salt="tenant"), [inst]) == {"a": [2, 0, 0, 0]}
    # LoRA blocks (keyed by the adapter's path and id, which events lack) and orphans are left out
    before = fleet.num_vllm_unmapped
    fleet.on_vllm_batch("a", [0.0, [_vllm_stored([31], None, tokens[:4], lora_name="ad")]])
    fleet.on_vllm_batch("a", [0.0, [_vllm_stored([41], 999, tokens[4:8])]])
    assert fleet.num_vllm_unmapped == before + 2
    # removals and a full clear
    fleet.on_vllm_batch("a", [0.0, [{"type": "BlockRemoved", "block_hashes": [14, 15, 16], "medium": "GPU"}]])
    assert fleet.match(arr, None, [inst]) == {"a": [3, 0, 0, 0]}
    fleet.on_vllm_batch("a", [0.0, [{"type": "AllBlocksCleared"}]])
    assert fleet.match(arr, None, [inst]) == {"a": [0, 0, 0, 0]}


def test_scoring_weighs_tiers_and_load_and_breaks_ties_round_robin() -> None:
    fleet = FleetView()
    doc = _hashes(list(range(16)))
    for name, tier in (("a", "pool"), ("b", "disk"), ("c", None)):
        src = _source(name)
        fleet.on_batch(1, _batch(src), "tcp://x:1")
        fleet.apply_snapshot(1, _snapshot(src, **({tier: doc} if tier else {})))
    chooser = Chooser(fleet, Scoring())
    query = parse_query({"token_ids": list(range(16))})
    answer = chooser.answer(query)
    assert answer["best"] == "a"
    assert answer["instances"]["b"]["by_tier"] == {"pool": 0, "cpu": 0, "disk": 16, "remote": 0}
    assert answer["instances"]["a"]["score"] > answer["instances"]["b"]["score"] > answer["instances"]["c"]["score"]
    # a busy pool holder loses to an idle disk holder once the load outweighs the difference
    assert chooser.answer(parse_query({"token_ids": list(range(16)), "load": {"a": 6}}))["best"] == "b"
    # nobody holds it: round-robin among the equally loaded
    cold = parse_query({"token_ids": list(range(500, 516))})
    assert {chooser.answer(cold)["best"] for _ in range(3)} == {"a", "b", "c"}
    assert chooser.answer(parse_query({"token_ids": list(range(16)), "model": "other"}))["best"] is None


@pytest.mark.parametrize("body, message", [
    ({"token_ids": [1, 2.0]}, "integers"), ({"token_ids": [1, None]}, "integers"), ({"token_ids": None}, "list"),
    ({"token_ids": [], "lora_id": [1]}, "lora_id"),
    ({"token_ids": [], "model": 3}, "model"), ({"token_ids": [], "x": 1}, "unknown fields"), ([], "JSON object"),
])
def test_bad_queries_name_the_bad_value(body: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_query(body)


def test_weights_parse_and_validate() -> None:
    assert Scoring.parse_weights("disk=0.2") == (1.0, 0.8, 0.2, 0.3)
    with pytest.raises(ConfigError, match="unknown tier"):
        Scoring.parse_weights("gpu=1")
    with pytest.raises(ConfigError, match="tier weights"):
        Scoring((1.0, 2.0, 0.0, 0.0))
