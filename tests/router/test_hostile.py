"""Hostile input to the router, generated (hypothesis): random and malformed batches, replay
answers and HTTP bodies. Whatever comes, the router raises nothing but its own 4xx, keeps
following every subscription, and keeps its state within its bounds."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.ports import free_port_pair
from router.config import RouterConfig, Subscription
from router.decode import BadMessage, decode_batch
from router.fleet import FleetView, Limits
from router.lookup import BadRequest, Chooser, Scoring, parse_body, parse_query
from router.thread import RouterThread

LIMITS = Limits(max_sources=4, max_blocks_per_slot=64, max_block_sizes=2, max_remote_slots=2, max_buffered=8,
                replay_interval_s=0.0)
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(0, 40))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=8),
                    st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)
MEDIA = st.sampled_from([None, "GPU", "CPU", "DISK", "SHARED", "CPU_PINNED", "bogus", 5])


@st.composite
def events(draw: Any) -> Any:
    """Mostly well-formed events with hostile fields, sometimes anything at all."""
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "junk"]))
    bs = draw(st.one_of(st.sampled_from([2, 4, 8]), values))
    n = draw(st.integers(0, 4))
    hashes = draw(st.lists(st.one_of(st.integers(0, 12), values), min_size=n, max_size=n))
    meta = draw(st.one_of(st.none(), st.fixed_dictionaries({
        "epoch": st.one_of(st.integers(0, 3), values), "remote": st.one_of(st.none(), st.sampled_from(["r1", "r2"]),
                                                                           values),
        "ns": st.one_of(st.sampled_from(["a", "b", "c"]), values), "model": st.one_of(st.text(max_size=4), values),
        "media": st.one_of(st.none(), st.lists(MEDIA, max_size=3), values),
        "block_size": st.one_of(st.none(), st.sampled_from([2, 4, 16]), values)}), values))
    if kind == "BlockStored":
        tokens = draw(st.one_of(st.lists(st.integers(0, 9), min_size=n * bs, max_size=n * bs)
                                if isinstance(bs, int) and 0 < bs <= 8 else st.just([]), values))
        return {"type": kind, "block_hashes": hashes, "parent_block_hash": draw(st.one_of(st.none(),
                                                                                        st.integers(0, 12), values)),
                "token_ids": tokens, "block_size": bs, "medium": draw(MEDIA), "lora_name": draw(
                    st.one_of(st.none(), st.sampled_from(["l"]), values)),
                "extra_keys": draw(st.one_of(st.none(), values)), "kvstrata": meta}
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": hashes, "medium": draw(MEDIA), "kvstrata": meta}
    if kind == "AllBlocksCleared":
        return {"type": kind, "kvstrata": meta}
    return draw(values)


payloads = st.one_of(
    st.builds(lambda ts, evs, rank: msgpack.packb([ts, evs, rank], use_bin_type=True),
              st.one_of(st.floats(), values), st.lists(events(), max_size=6), values),
    st.builds(lambda v: msgpack.packb(v, use_bin_type=True), values),
    st.binary(max_size=64))


def check_bounds(fleet: FleetView) -> None:
    slots = [s.slot for s in fleet.sources.values()]
    assert all(len(slot.chain) <= LIMITS.max_blocks_per_slot for slot in slots)
    assert len(fleet.index) <= len(slots) * LIMITS.max_blocks_per_slot
    assert len(fleet.remote_groups) <= LIMITS.max_remote_slots
    for slot in slots:  # the index holds nothing the chain maps do not (two hashes of one key may hold less)
        assert all(fleet.index.count(slot.index, t) <= len({key for key, bits in slot.chain.values() if bits >> t & 1})
                   for t in range(4))
    assert len({s.block_size for s in fleet.sources.values()} - {None}) <= LIMITS.max_block_sizes
    assert all(len(s.buffered) <= LIMITS.max_buffered + 1 for s in fleet.sources.values())


def feed_payload(fleet: FleetView, endpoint: str, seq: int, payload: bytes) -> None:
    try:
        decoded, _ = decode_batch(payload)
    except BadMessage:
        fleet.num_bad_messages += 1
        return
    fleet.on_live(fleet.sources[endpoint], seq, decoded, 0.0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), payloads), max_size=25),
       st.lists(st.lists(st.tuples(st.integers(0, 40), payloads), max_size=4), max_size=3))
def test_random_batches_and_replays_never_raise_and_stay_bounded(stream: Any, replays: Any) -> None:
    fleet = FleetView(LIMITS)
    for i in range(4):
        fleet.add(f"tcp://s{i}:1", f"s{i % 2}", replay=f"tcp://s{i}:2")
    for source, seq, payload in stream:
        feed_payload(fleet, f"tcp://s{source}:1", seq, payload)
        check_bounds(fleet)
    for i, answer in enumerate(replays):
        src = fleet.sources[f"tcp://s{i}:1"]
        batches = []
        for seq, payload in answer:
            with contextlib.suppress(BadMessage):
                batches.append((seq, decode_batch(payload)[0]))
        fleet.on_replay(src, 0, batches)
        check_bounds(fleet)
    Chooser(fleet, Scoring()).answer(parse_query({"token_ids": list(range(16))}), now=0.0)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(),
                                     st.text(max_size=6)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.sampled_from(
                                                       ["token_ids", "cache_salt", "lora_id", "model", "load", "x"]),
                                                       inner, max_size=5)), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.one_of(json_values, st.fixed_dictionaries({"token_ids": st.lists(st.integers(-5, 2**33), max_size=8)},
                                                    optional={"load": json_values, "lora_id": json_values,
                                                              "cache_salt": json_values})))
def test_random_lookup_bodies_are_answers_or_bad_requests(body: Any) -> None:
    fleet = FleetView(LIMITS)
    try:
        raw = json.dumps(body).encode()
    except ValueError:
        return
    with contextlib.suppress(BadRequest):
        Chooser(fleet, Scoring()).answer(parse_query(parse_body(raw)), now=0.0)


@pytest.fixture
def served() -> Any:
    port = free_port_pair()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    router = RouterThread(RouterConfig(subscriptions=(Subscription(f"tcp://127.0.0.1:{port}", "a"),), limits=LIMITS))
    time.sleep(0.5)
    yield router, pub
    router.stop()
    pub.close(linger=0)
    ctx.term()


def _post(url: str, body: bytes) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _matched_tokens(url: str, instance: str) -> int | None:
    """What `/lookup` at `url` says `instance` holds of tokens 1..4."""
    with urllib.request.urlopen(urllib.request.Request(url, data=b'{"token_ids": [1, 2, 3, 4]}', method="POST"),
                                timeout=10) as resp:
        matched: int | None = json.loads(resp.read())["instances"].get(instance, {}).get("matched_tokens")
        return matched


def test_a_real_subscription_outlives_garbage_and_http_never_answers_500(served: Any) -> None:
    router, pub = served
    garbage = [[b"", b"x"], [b"", b"\x00" * 8, b"\xc1"], [b"", b"\x00" * 8, msgpack.packb([float("inf"), [], 0])],
               [b"", (1).to_bytes(8, "big"), msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [[1]],
                                                                      "token_ids": 5, "epoch": float("inf")}], 0])],
               [b"", (2).to_bytes(8, "big"), msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1],
                                                                      "parent_block_hash": None, "block_size": 4,
                                                                      "token_ids": [1, 2, 3, 4], "medium": "CPU",
                                                                      "kvstrata": {"epoch": float("inf")}}], 0])],
               [b"", b"\x00" * 8, msgpack.packb([0.0, [[[[[[[[]]]]]]]] * 3, 0])]]
    for frames in garbage:
        pub.send_multipart(frames)
    good = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
            "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None}
    url = router.url + "/lookup"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the subscription is alive: a good batch after the garbage lands
        pub.send_multipart([b"", (3).to_bytes(8, "big"), msgpack.packb([0.0, [good], 0])])
        if _matched_tokens(url, "a") == 4:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the subscription died on malformed messages")
    assert router.call(lambda: router.router.fleet.num_bad_messages + router.router.fleet.num_bad_events) >= 5
    for body in (b"[" * 50_000, b'{"token_ids": [1], "load": {"a": 1' + b"0" * 400 + b"}}", b"\xff\xfe",
                 b'{"token_ids": [1e999]}', b'{"token_ids": [' + b"9" * 5000 + b"]}", b"null"):
        assert _post(url, body) == 400, body[:40]
    assert _post(router.url + "/register", b'{"endpoint": "tcp://127.0.0.1:1", "x": 1}') == 400


def nested_removal(depth: int = 1000, declared: int = 1 << 24) -> bytes:
    """A removal whose hash list declares `declared` entries, nested `depth` deep, in about
    5 KB: what msgpack would reserve for it is far beyond what the bytes hold."""
    event = (b"\x82" + msgpack.packb("type") + msgpack.packb("BlockRemoved") + msgpack.packb("block_hashes")
             + (b"\xdd" + declared.to_bytes(4, "big")) * depth)
    return b"\x93" + msgpack.packb(0.0) + b"\x91" + event


def test_declared_lengths_cost_only_the_bytes_that_came() -> None:
    """40 batches of 5 KB each declaring 2^24 hashes nested 1000 deep: each is a counted
    drop, and decoding them all reserves next to nothing."""
    import tracemalloc

    payloads = [nested_removal() for _ in range(40)] + [nested_removal(declared=5000)]
    tracemalloc.start()
    try:
        for payload in payloads:
            assert len(payload) < 6000
            with pytest.raises(BadMessage):
                decode_batch(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding 5 KB payloads reserved {peak >> 20} MiB"


def test_values_nested_deeply_are_bad_events_not_a_crash() -> None:
    """A deeply nested value where a number belongs is one malformed event (printing it in
    the reason would exhaust the interpreter's recursion)."""
    deep: Any = 0
    for _ in range(1000):
        deep = [deep]
    good = {"type": "AllBlocksCleared"}
    for field in ("epoch", "block_size"):
        payload = msgpack.packb([0.0, [{"type": "AllBlocksCleared", "kvstrata": {field: deep}}, good], 0])
        events, bad = decode_batch(payload)
        assert bad == 1 and len(events) == 1
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
              "block_size": deep, "medium": "CPU"}
    assert decode_batch(msgpack.packb([0.0, [stored], 0]))[1] == 1


def test_a_subscription_outlives_oversized_declarations_and_lookups_answer(served: Any) -> None:
    router, pub = served
    deep: Any = 0
    for _ in range(1000):
        deep = [deep]
    hostile = [nested_removal() for _ in range(40)]
    hostile.append(msgpack.packb([0.0, [{"type": "AllBlocksCleared", "kvstrata": {"epoch": deep}}], 0]))
    good = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
            "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None}
    url = router.url + "/lookup"
    deadline = time.monotonic() + 20
    seq = 0
    while time.monotonic() < deadline:
        for payload in hostile:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([0.0, [good], 0])])
        seq += 1
        if _matched_tokens(url, "a") == 4:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the subscription died on oversized declarations")
    assert router.call(lambda: router.router.fleet.num_bad_messages) >= 40


class Publisher:
    """A bare publisher on loopback (XPUB: it knows when a reader has subscribed)."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(self.endpoint)
        self.seq = 0

    def wait_for_reader(self) -> None:
        assert self.sock.poll(30_000), "no reader subscribed"
        self.sock.recv()

    def send(self, *events: dict[str, Any]) -> None:
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), msgpack.packb([time.time(), list(events), 0])])
        self.seq += 1


@pytest.mark.slow
def test_a_flood_of_restart_claims_neither_starves_lookups_nor_an_honest_restart(tmp_path: Any) -> None:
    """2^17 blocks indexed, one endpoint sending ~150 tiny batches a second, each claiming a
    fresh instance id and epoch: the router takes them as they come (a walk of the whole
    index per claim cost 24 ms each, 3.5 s of work a second: the backlog only grew), lookups
    keep answering, and an honest store restarted over its warm disk is indexed again within
    a bound (about 1 s on an idle machine without the flood)."""
    import secrets
    import threading

    from tests.conftest import BLOCK
    from tests.router.test_router import Instance, RouterProcess, doc, expect, wait_for

    ctx = zmq.Context()
    bulk, flood = Publisher(ctx), Publisher(ctx)
    honest = Instance("honest", free_port_pair(), tmp_path / "honest", 4)
    router = RouterProcess([f"bulk={bulk.endpoint}", f"flood={flood.endpoint}", honest.subscription])
    stop = threading.Event()
    sender = None

    def metrics() -> dict[str, float]:
        return {line.split()[0]: float(line.split()[-1]) for line in router.get("/metrics")[1].splitlines()
                if line and not line.startswith("#")}

    try:
        bulk.wait_for_reader()
        flood.wait_for_reader()
        per, parent = 4096, None
        for first in range(1, (1 << 17) + 1, per):
            hashes = list(range(first, first + per))
            bulk.send({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                       "token_ids": [h % 50_000 for h in hashes for _ in range(BLOCK)], "block_size": BLOCK,
                       "lora_id": None, "medium": "CPU", "lora_name": None})
            parent = hashes[-1]
        wait_for(lambda: metrics().get("kvstrata_router_indexed_blocks", 0) >= 1 << 17,
                 "the router to index 2^17 blocks", timeout=120)
        d = doc(1, 4)
        honest.call("store", d)
        expect(router, d, {"honest": ["cpu"] * 4})

        def spam() -> None:
            t_end = time.monotonic() + 8
            while not stop.is_set() and time.monotonic() < t_end:
                flood.send({"type": "AllBlocksCleared",
                            "kvstrata": {"instance": secrets.token_hex(8), "epoch": secrets.randbits(62)}})
                time.sleep(1 / 150)

        sender = threading.Thread(target=spam, daemon=True)
        sender.start()
        time.sleep(2)
        honest = honest.restart()
        assert honest.call("where", d) == ["disk"] * 4
        t0 = time.monotonic()
        expect(router, d, {"honest": ["disk"] * 4})  # every lookup answers within 10 s
        took = time.monotonic() - t0
        assert took < 10, f"the honest restart took {took:.1f} s to be indexed under the flood"
        sender.join(timeout=30)
        sent = flood.seq
        wait_for(lambda: metrics()["kvstrata_router_event_batches_total"] >= sent + (1 << 17) // per,
                 f"the router to take the {sent} batches of the flood", timeout=10)
        after = metrics()
        assert after["kvstrata_router_throttled_total"] > 0, "the flood's claims past its budget are counted"
        assert after["kvstrata_router_indexed_blocks"] >= 1 << 17, "the flood took nothing of the bulk source's"
    finally:
        stop.set()
        if sender is not None:
            sender.join(timeout=10)
        router.stop()
        if honest.proc.poll() is None:
            honest.kill()
        for pub in (bulk, flood):
            pub.sock.close(linger=0)
        ctx.term()
