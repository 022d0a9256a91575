"""The router's pure parts: the index, the fleet view's stream logic, the mapping of events
onto the router's own key chain, the bounds, and the scoring."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from kvstore.errors import ConfigError
from router import keys as keys_mod
from router.decode import decode_batch
from router.fleet import FleetFull, FleetView, Limits
from router.index import KVIndex, tier_masks
from router.lookup import BadRequest, Chooser, Scoring, parse_body, parse_query

BS = 4


def batch(*events: dict[str, Any]) -> list[Any]:
    """Events as a reader decodes them off the wire."""
    return decode_batch(msgpack.packb([0.0, list(events), 0]))[0]


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "CPU", *,
           meta: dict[str, Any] | None = None, extra: list[Any] | None = None, lora: str | None = None,
           bs: int = BS) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
             "block_size": bs, "lora_id": None, "medium": medium, "lora_name": lora}
    if extra is not None:
        event["extra_keys"] = extra
    if meta is not None:
        event["kvstrata"] = meta
    return event


def removed(hashes: list[int], medium: str = "CPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared(media: list[str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"type": "AllBlocksCleared", "kvstrata": {**meta, "media": media}}


def match(fleet: FleetView, tokens: list[int], salt: str | None = None, lora: str | None = None,
          ) -> dict[str, list[int]]:
    out = fleet.match(np.asarray(tokens, dtype="<u4"), salt, lora, fleet.instances())
    return {name: counts for name, (counts, _) in out.items()}


def feed(fleet: FleetView, endpoint: str, *events: dict[str, Any], seq: int | None = None) -> None:
    src = fleet.sources[endpoint]
    fleet.on_live(src, (src.seq + 1 if src.seq is not None else 0) if seq is None else seq, batch(*events), 0.0)


def test_index_counts_the_fastest_tier_of_each_group() -> None:
    index = KVIndex()
    keys = [11, 12, 13, 14, 15]
    index.add(0, 1, keys[:4])  # slot 0: cpu
    index.add(0, 0, keys[:2])  # and pool for the first two
    index.add(1, 2, keys)  # slot 1: disk
    assert index.match(keys, [tier_masks([(0, 0xF)]), tier_masks([(1, 0xF)])]) == [[2, 2, 0, 0], [0, 0, 5, 0]]
    index.remove(1, 2, keys[2:3])  # a hole ends slot 1's prefix
    assert index.match(keys, [tier_masks([(1, 0xF)])]) == [[0, 0, 2, 0]]
    index.add(2, 3, keys)  # a remote slot read by slot 1 fills the hole
    assert index.match(keys, [tier_masks([(1, 0xF), (2, 1 << 3)])]) == [[0, 0, 4, 1]]
    index.add(2, 3, keys)  # again: nothing changes
    assert [index.count(s, t) for s, t in ((0, 0), (0, 1), (1, 2), (2, 3))] == [2, 4, 4, 5]
    index.remove(0, 1, keys)
    index.remove(0, 0, keys)
    index.remove(1, 2, keys)
    index.remove(2, 3, keys)
    assert len(index) == 0 and index.count(2, 3) == 0


def test_blocks_are_indexed_by_the_routers_own_chain_with_salt_and_lora() -> None:
    fleet = FleetView()
    fleet.add("tcp://a:1", "a")
    tokens = list(range(100, 124))  # 6 blocks, stored in two steps
    feed(fleet, "tcp://a:1", stored([11, 12, 13], None, tokens[:12]), stored([14, 15, 16], 13, tokens[12:], "DISK"))
    assert match(fleet, tokens) == {"a": [0, 3, 3, 0]}
    assert match(fleet, tokens[:4] + [0] * 4) == {"a": [0, 1, 0, 0]}
    # a salt on a sequence's first block (vLLM's extra_keys) matches only a salted query
    feed(fleet, "tcp://a:1", stored([21, 22], None, tokens[:8], extra=[["tenant"], None]))
    assert match(fleet, tokens[:8], salt="tenant") == {"a": [0, 2, 0, 0]}
    # LoRA blocks (the name leads each extra_keys entry) match a query naming the adapter
    feed(fleet, "tcp://a:1", stored([31], None, tokens[:4], lora="ad", extra=[["ad"]]))
    assert match(fleet, tokens[:4], lora="ad") == {"a": [0, 1, 0, 0]}
    # multimodal keys, a salt off the first block and an unknown parent are left out, counted
    before = fleet.num_unmapped
    feed(fleet, "tcp://a:1", stored([41], None, tokens[:4], extra=[[["f" * 64, 0]]]),
         stored([42], 11, tokens[4:8], extra=[["salt-later"]]), stored([43], 999, tokens[4:8]))
    assert fleet.num_unmapped == before + 3
    # removals and a full clear
    feed(fleet, "tcp://a:1", removed([14, 15, 16], "DISK"))
    assert match(fleet, tokens) == {"a": [0, 3, 0, 0]}
    feed(fleet, "tcp://a:1", {"type": "AllBlocksCleared"})
    assert match(fleet, tokens) == {"a": [0, 0, 0, 0]}


def test_the_query_chain_equals_the_stores_chain_from_token_ids() -> None:
    """The keys a query hashes to are those a publisher's chain maps to, block by block."""
    tokens = np.arange(40, dtype="<u4")
    ks = keys_mod.chain(tokens, 8, salt="s", lora="7")
    parent = keys_mod.ROOT
    for i, key in enumerate(ks):
        parent = keys_mod.block_key(parent, tokens[i * 8 : (i + 1) * 8].tobytes(), keys_mod.extras("s", "7", i == 0))
        assert key == parent


def test_a_batch_cannot_act_for_another_source() -> None:
    """Identity is the endpoint: naming a victim in a message changes nothing of the victim's."""
    fleet = FleetView()
    fleet.add("tcp://victim:1", "victim")
    fleet.add("tcp://attacker:1", "attacker")
    feed(fleet, "tcp://victim:1", stored([1, 2], None, list(range(8)), meta={"instance": "victim", "epoch": 1}))
    for _ in range(3):  # "the victim's" next batches, sent by the attacker, clears and all
        feed(fleet, "tcp://attacker:1", cleared(None, instance="victim", epoch=2), removed([1, 2]),
             seq=fleet.sources["tcp://victim:1"].seq + 1)  # type: ignore[operator]
    assert match(fleet, list(range(8)))["victim"] == [0, 2, 0, 0]


def test_a_shared_remote_slot_is_per_server_and_namespace() -> None:
    fleet = FleetView()
    for name, ns in (("x1", "model-x"), ("x2", "model-x"), ("y", "model-y")):
        fleet.add(f"tcp://{name}:1", name)
        feed(fleet, f"tcp://{name}:1", cleared(["GPU", "CPU", "DISK"], remote="redis://r:6379", ns=ns, epoch=1,
                                               block_size=BS))
    meta_x = {"remote": "redis://r:6379", "ns": "model-x", "epoch": 1}
    meta_y = {"remote": "redis://r:6379", "ns": "model-y", "epoch": 1}
    feed(fleet, "tcp://x1:1", stored([1, 2], None, list(range(8)), "SHARED", meta=meta_x))
    feed(fleet, "tcp://y:1", stored([1, 2], None, list(range(8)), "SHARED", meta=meta_y))
    assert match(fleet, list(range(8))) == {"x1": [0, 0, 0, 2], "x2": [0, 0, 0, 2], "y": [0, 0, 0, 2]}
    # model x's store clears its remote namespace: model y's blocks on the same server stay
    feed(fleet, "tcp://x1:1", cleared(["GPU", "CPU", "DISK", "SHARED"], **meta_x))
    assert match(fleet, list(range(8))) == {"x1": [0, 0, 0, 0], "x2": [0, 0, 0, 0], "y": [0, 0, 0, 2]}


def test_restarts_gaps_and_replays() -> None:
    fleet = FleetView(Limits(replay_interval_s=0.0))
    src = fleet.add("tcp://a:1", "a", replay="tcp://a:2")
    assert fleet.on_live(src, 0, batch(stored([1], None, [1, 2, 3, 4])), 0.0) is None
    assert fleet.on_live(src, 3, batch(stored([2], 1, [5, 6, 7, 8])), 0.0) == 1  # a gap: replay from 1
    assert src.replaying and fleet.on_live(src, 4, batch(removed([1])), 0.0) is None  # buffered meanwhile
    fleet.on_replay(src, 1, [(1, batch()), (2, batch(stored([3], None, list(range(4)))))])
    assert src.seq == 4 and match(fleet, [1, 2, 3, 4]) == {"a": [0, 0, 0, 0]}
    assert match(fleet, list(range(4))) == {"a": [0, 1, 0, 0]}
    # a batch numbered from 0 again: the publisher restarted, its old blocks are gone
    fleet.on_live(src, 0, batch(), 0.0)
    assert match(fleet, list(range(4))) == {"a": [0, 0, 0, 0]} and fleet.num_restarts == 1
    # so is a new kvstrata epoch
    fleet.on_live(src, 1, batch(stored([5], None, list(range(4)), meta={"epoch": 7})), 0.0)
    fleet.on_live(src, 2, batch(cleared(["CPU"], epoch=8)), 0.0)
    assert fleet.num_restarts == 2 and match(fleet, list(range(4))) == {"a": [0, 0, 0, 0]}
    # a kvstrata store's next lifetime numbers its batches above the last one's: with a new
    # epoch that is a restart, not a gap to replay
    assert fleet.on_live(src, 10**15, batch(stored([6], None, list(range(4)), meta={"epoch": 9})), 0.0) is None
    assert fleet.num_restarts == 3 and not src.replaying and match(fleet, list(range(4))) == {"a": [0, 1, 0, 0]}


def test_everything_kept_per_source_is_bounded() -> None:
    fleet = FleetView(Limits(max_sources=3, max_blocks_per_slot=5, max_block_sizes=2, forget_after_s=10))
    for i in range(3):
        fleet.add(f"tcp://s{i}:1", f"s{i}")
    with pytest.raises(FleetFull):
        fleet.add("tcp://s3:1", "s3")
    feed(fleet, "tcp://s0:1", stored(list(range(1, 11)), None, list(range(40))))
    assert len(fleet.sources["tcp://s0:1"].slot.chain) == 5 and fleet.num_dropped_blocks == 5
    feed(fleet, "tcp://s1:1", stored([1], None, list(range(8)), bs=8))
    feed(fleet, "tcp://s2:1", stored([1], None, list(range(16)), bs=16))  # a third block size: refused
    assert fleet.sources["tcp://s2:1"].block_size is None and fleet.num_unmapped >= 1
    for src in fleet.sources.values():
        src.last_seen = 0.0
    fleet.sweep(now=100.0)  # silent for longer than forget_after_s: their state is freed
    assert len(fleet.index) == 0 and all(not s.slot.chain for s in fleet.sources.values())


def test_lookup_hashes_once_per_block_size_whatever_the_sources_say(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = FleetView()
    for i in range(16):
        fleet.add(f"tcp://s{i}:1", f"s{i}")
        feed(fleet, f"tcp://s{i}:1", stored([i + 1], None, list(range(4)),
                                            meta={"epoch": i, "ns": str(i) * 30, "model": f"m{i}"}))
    calls = []
    real = keys_mod.chain
    monkeypatch.setattr("router.fleet.chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert all(c == [0, 1, 0, 0] for c in match(fleet, list(range(4))).values())
    assert len(calls) == 1


def test_scoring_weighs_tiers_and_load_and_breaks_ties_round_robin() -> None:
    fleet = FleetView()
    for name, medium in (("a", "GPU"), ("b", "DISK"), ("c", None)):
        fleet.add(f"tcp://{name}:1", name)
        if medium:
            feed(fleet, f"tcp://{name}:1", stored([1, 2, 3, 4], None, list(range(16)), medium))
        else:
            feed(fleet, f"tcp://{name}:1", cleared(None, block_size=BS))
    chooser = Chooser(fleet, Scoring())
    answer = chooser.answer(parse_query({"token_ids": list(range(16))}), now=0.0)
    assert answer["best"] == "a"
    assert answer["instances"]["b"]["by_tier"] == {"pool": 0, "cpu": 0, "disk": 16, "remote": 0}
    assert answer["instances"]["a"]["score"] > answer["instances"]["b"]["score"] > answer["instances"]["c"]["score"]
    assert chooser.answer(parse_query({"token_ids": list(range(16)), "load": {"a": 6}}), now=0.0)["best"] == "b"
    cold = parse_query({"token_ids": list(range(500, 516))})
    assert {chooser.answer(cold, now=0.0)["best"] for _ in range(3)} == {"a", "b", "c"}
    assert chooser.answer(parse_query({"token_ids": [], "model": "other"}), now=0.0)["best"] is None


@pytest.mark.parametrize("body, message", [
    ({"token_ids": [1, 2.0]}, "integers"), ({"token_ids": [1, None]}, "integers"), ({"token_ids": None}, "list"),
    ({"token_ids": [], "lora_id": [1]}, "lora_id"), ({"token_ids": [], "lora_id": 2**70}, "lora_id"),
    ({"token_ids": [], "model": 3}, "model"), ({"token_ids": [], "x": 1}, "unknown fields"), ([], "JSON object"),
    ({"token_ids": [], "load": {"a": 10**400}}, "load"), ({"token_ids": [], "load": {"a": float("nan")}}, "load"),
    ({"token_ids": [], "cache_salt": "\ud800"}, "UTF-8"),
])
def test_bad_queries_name_the_bad_value(body: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_query(body)


def test_bodies_nested_too_deeply_are_bad_requests() -> None:
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_body(b"[" * 200_000 + b"]" * 200_000)


def test_weights_parse_and_validate() -> None:
    assert Scoring.parse_weights("disk=0.2") == (1.0, 0.8, 0.2, 0.3)
    with pytest.raises(ConfigError, match="unknown tier"):
        Scoring.parse_weights("gpu=1")
    with pytest.raises(ConfigError, match="tier weights"):
        Scoring((1.0, 2.0, 0.0, 0.0))


class NoScan(dict):  # type: ignore[type-arg]
    """The index's dict, refusing every walk over it."""

    def _walk(self, *args: Any) -> Any:
        raise AssertionError("the whole index was walked")

    items = keys = values = __iter__ = _walk  # type: ignore[assignment]


def test_a_restart_costs_what_its_source_holds_and_claims_are_rate_limited() -> None:
    """A source claiming a new epoch and a clear 150 times a second: what it holds is
    forgotten without walking the index, at most the burst and the rate of its claims are
    taken (the rest counted as throttled), and no other source loses a block."""
    fleet = FleetView()
    fleet.add("tcp://honest:1", "honest")
    flood = fleet.add("tcp://flood:1", "flood")
    tokens = list(range(4 * 4096))
    feed(fleet, "tcp://honest:1", stored(list(range(1, 4097)), None, tokens, meta={"epoch": 1}))
    fleet.index._blocks = NoScan(fleet.index._blocks)  # a structural check: nothing walks the index
    for i in range(150):
        flood.last_seen = 0.0
        fleet.on_live(flood, i, batch(stored([i + 1], None, tokens[:4], meta={"epoch": i, "instance": f"x{i}"}),
                                      cleared(None, epoch=i)), i / 150)
    limits = fleet.limits
    taken = 150 - fleet.num_throttled
    assert 1 <= taken <= limits.burst_claims + limits.claims_per_s + 1 and flood.num_throttled == fleet.num_throttled
    assert match(fleet, tokens)["honest"] == [0, 4096, 0, 0]
    assert fleet.index.count(flood.slot.index, 1) <= 1


def test_a_source_changes_only_what_it_announced_in_a_shared_tier() -> None:
    """A hostile source claiming a victim's remote identity and namespace (both public in
    its events) and clearing the shared tier, or removing its blocks, takes nothing of the
    victim's: a block leaves the shared view only once no member announcing it holds it."""
    fleet = FleetView()
    meta = {"remote": "redis://r:6379", "ns": "ns-x", "epoch": 1, "block_size": BS}
    for name in ("a", "b", "evil"):
        fleet.add(f"tcp://{name}:1", name)
        feed(fleet, f"tcp://{name}:1", cleared(["GPU", "CPU", "DISK"], **meta))
    tokens = list(range(8))
    feed(fleet, "tcp://a:1", stored([1, 2], None, tokens, "SHARED", meta=meta))
    assert match(fleet, tokens) == {"a": [0, 0, 0, 2], "b": [0, 0, 0, 2], "evil": [0, 0, 0, 2]}
    feed(fleet, "tcp://evil:1", cleared(["SHARED"], **meta), removed([1, 2], "SHARED"), cleared(None, **meta))
    feed(fleet, "tcp://evil:1", stored([1, 2], None, tokens, "SHARED", meta=meta), cleared(["SHARED"], **meta))
    feed(fleet, "tcp://evil:1", cleared(None, **{**meta, "epoch": 2}))  # a "restart" of its own
    assert match(fleet, tokens)["b"] == [0, 0, 0, 2]
    # two members announce a block: it stays until both have dropped it
    feed(fleet, "tcp://b:1", stored([1], None, tokens[:4], "SHARED", meta=meta))
    feed(fleet, "tcp://a:1", cleared(["SHARED"], **meta))
    assert match(fleet, tokens)["evil"] == [0, 0, 0, 1]
    feed(fleet, "tcp://b:1", removed([1], "SHARED"))
    assert match(fleet, tokens) == {"a": [0, 0, 0, 0], "b": [0, 0, 0, 0], "evil": [0, 0, 0, 0]}
    # a member moving to another tier takes its remote blocks with it (they were not the new one's)
    feed(fleet, "tcp://a:1", stored([1, 2], None, tokens, "SHARED", meta=meta))
    feed(fleet, "tcp://a:1", cleared(["GPU"], **{**meta, "ns": "ns-y"}))
    assert match(fleet, tokens) == {"a": [0, 0, 0, 0], "b": [0, 0, 0, 0], "evil": [0, 0, 0, 0]}
