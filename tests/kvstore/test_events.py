"""KV events of a store in vLLM's wire format: real ZeroMQ sockets on loopback, decoded as a
third-party reader would (plain msgpack, vLLM's field names)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from cli.ports import free_port_pair
from kvevents import END_SEQ, wire_hash
from kvevents import publisher as events_mod
from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.keys import TierKind


class Reader:
    """A SUB socket and a replay DEALER, as Dynamo or llm-d would connect."""

    def __init__(self, port: int, ctx: zmq.Context[Any] | None = None, curve: dict[str, bytes] | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.port, self.curve = port, curve
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.batches: list[tuple[int, list[dict[str, Any]]]] = []

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in (self.curve or {}).items():
            setattr(sock, name, value)
        return sock

    def drain(self, seconds: float) -> list[tuple[int, list[dict[str, Any]]]]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sub.poll(50):
                _topic, seq, payload = self.sub.recv_multipart()
                ts, events, dp_rank = msgpack.unpackb(payload)
                assert isinstance(ts, float) and dp_rank == 0
                self.batches.append((int.from_bytes(seq, "big"), events))
        return self.batches

    def events(self) -> list[dict[str, Any]]:
        return [e for _, batch in self.batches for e in batch]

    def until(self, done: Any, timeout: float = 20.0) -> list[tuple[int, list[dict[str, Any]]]]:
        """Drain until `done(self.events())` holds, or `timeout` seconds (generous: the machine
        may be busy); the batches received."""
        deadline = time.monotonic() + timeout
        while not done(self.events()) and time.monotonic() < deadline:
            self.drain(0.2)
        return self.batches

    def welcomed(self, timeout: float = 20.0) -> list[tuple[int, list[dict[str, Any]]]]:
        """Drain until the welcome a new reader gets (it opens with `AllBlocksCleared`) has come:
        after it, every change is live (a fixed wait lost the first batches on a busy machine,
        before the subscription reached the publisher)."""
        return self.until(lambda events: any(e["type"] == "AllBlocksCleared" for e in events), timeout)

    def until_stored(self, timeout: float = 20.0) -> list[tuple[int, list[dict[str, Any]]]]:
        """Drain until a BlockStored event has come (or `timeout`)."""
        return self.until(lambda events: any(e["type"] == "BlockStored" for e in events), timeout)

    def replay(self, start: int, timeout_ms: int = 5000) -> list[tuple[int, list[dict[str, Any]]]] | None:
        """vLLM's replay protocol; None if no end marker came."""
        dealer = self._socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.port + 1}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while dealer.poll(timeout_ms):
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
            return None
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close(linger=0)


def _store(path: Path, port: int, *, cpu_blocks: int = 8, **kw: Any) -> KVCacheStore:
    return KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK),
                                    disk_path=str(path), disk_bytes=16 << 20, disk_sync=False,
                                    events_endpoint=f"tcp://127.0.0.1:{port}", instance_id="inst-a", **kw))


def held(events: list[dict[str, Any]]) -> dict[str, set[int]]:
    """What a reader following `events` believes each medium holds."""
    out: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "DISK": set(), "SHARED": set()}
    for e in events:
        if e["type"] == "BlockStored":
            out[e["medium"]].update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            out[e["medium"]].difference_update(e["block_hashes"])
        elif e["type"] == "AllBlocksCleared":
            for medium in e["kvstrata"]["media"] or list(out):
                out[medium].clear()
    return out


def test_events_name_each_tier_chain_their_blocks_and_follow_evictions(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port, cpu_blocks=4)
    reader = Reader(port)
    try:
        reader.welcomed()
        tokens = list(range(24))  # 6 blocks: 4 stay in the CPU tier, 2 go to disk
        store.store(tokens, make_kv(24))
        hashes = [wire_hash(h) for h in store.block_hashes(tokens)]
        where = [kind.value for kind in store.locate(tokens)]
        want_cpu = {h for h, w in zip(hashes, where) if w == "cpu"}
        want_disk = {h for h, w in zip(hashes, where) if w == "disk"}
        deadline = time.monotonic() + 20  # until the reader follows the store: bounded, for a busy machine
        while time.monotonic() < deadline:
            reader.drain(0.5)
            state = held(reader.events())
            if state["CPU"] == want_cpu and want_disk <= state["DISK"]:
                break
        seqs = [s for s, _ in reader.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers must count batches"
        stored = [e for e in reader.events() if e["type"] == "BlockStored"]
        # parents before children, token ids per block, the first block's parent is None
        seen: dict[int, list[int]] = {}
        for e in stored:
            assert e["block_size"] == BLOCK and len(e["token_ids"]) == BLOCK * len(e["block_hashes"])
            assert e["parent_block_hash"] is None or e["parent_block_hash"] in seen
            for i, h in enumerate(e["block_hashes"]):
                seen[h] = e["token_ids"][i * BLOCK : (i + 1) * BLOCK]
            assert e["kvstrata"]["instance"] == "inst-a" and "seed" not in e["kvstrata"]
        assert [seen[h] for h in hashes] == [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(6)]
        state = held(reader.events())
        assert state["CPU"] == want_cpu and len(state["CPU"]) == 4
        assert want_disk <= state["DISK"] and len(want_disk) == 2
    finally:
        reader.close()
        store.close()


def test_a_restarted_store_clears_and_announces_its_warm_disk_root_first(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    tokens = list(range(16))
    store.store(tokens, make_kv(16))
    hashes = [wire_hash(h) for h in store.block_hashes(tokens)]
    store.close()  # persists the CPU tier to disk
    store = _store(tmp_path / "d", port)  # a restarted instance: empty memory, warm disk
    reader = Reader(port)
    try:
        deadline = time.monotonic() + 20  # a new reader gets the state broadcast; bounded wait on a busy machine
        while time.monotonic() < deadline:
            events = [e for _, b in reader.drain(0.5) for e in b]
            if sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored") >= len(hashes):
                break
        assert events[0]["type"] == "AllBlocksCleared" and events[0]["kvstrata"]["media"] is None  # all it announced
        disk = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "DISK"]
        assert disk and disk[0]["parent_block_hash"] is None and disk[0]["block_hashes"][0] == hashes[0]
        assert [h for e in disk for h in e["block_hashes"]] == hashes
        assert [t for e in disk for t in e["token_ids"]] == tokens
    finally:
        reader.close()
        store.close()


def test_replay_serves_the_buffer_then_the_whole_state_without_the_store_lock(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    reader = Reader(port)
    try:
        store.store(list(range(8)), make_kv(8))
        last = reader.until_stored()[-1][0]
        events = store.events
        assert events is not None
        replies: list[Any] = []

        def replay_under_the_lock(num_blocks: int) -> list[torch.Tensor]:  # a load calls it holding the lock
            replies.append(reader.replay(last))  # a replay never waits on the store's lock
            events.drop_replay_buffer()  # what it asks for is now older than the buffer
            replies.append(reader.replay(0))
            return [torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype) for _ in range(num_blocks)]

        assert store.blocks.load(store.keys(list(range(8))), replay_under_the_lock).num_blocks == 2
        buffered, whole = replies
        assert buffered is not None and buffered[0][0] == last
        assert whole is not None, "a replay must be answered while the store's lock is held"
        state = held([e for _, b in whole for e in b])
        assert state["CPU"] == {wire_hash(h) for h in store.block_hashes(list(range(8)))}
        assert all(seq == whole[0][0] for seq, _ in whole), "whole-state batches carry the latest number"
    finally:
        reader.close()
        store.close()


def test_whole_state_replays_are_rate_limited_per_peer(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    reader = Reader(port)
    try:
        store.store(list(range(8)), make_kv(8))
        reader.until_stored()
        assert store.events is not None
        store.events.drop_replay_buffer()
        answers = [reader.replay(0) for _ in range(12)]
        assert all(a is not None for a in answers), "a refused request still gets the end marker"
        full = sum(1 for a in answers if a)
        assert 1 <= full <= 4 and store.events.num_refused >= 8, (full, store.events.num_refused)
    finally:
        reader.close()
        store.close()


def test_oversized_and_malformed_requests_cost_nothing(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port + 1}")
        dealer.send_multipart([b"", b"x" * (64 << 20)])  # over the socket's MAXMSGSIZE: the peer is dropped
        dealer.send_multipart([b"", b"short"])  # a malformed request: counted
        # an oversized subscription, from a process of its own (libzmq 4.3 crashes the sender's
        # context when the receiver drops it for its size)
        attack = ("import time, zmq; s = zmq.Context().socket(zmq.XSUB); "
                  f"s.connect('tcp://127.0.0.1:{port}'); s.send(b'\\x01' + b't' * (8 << 20)); time.sleep(1); "
                  "import os; os._exit(0)")
        subprocess.run([sys.executable, "-c", attack], timeout=60, check=True)
        assert store.events is not None
        assert store.events.inbound_limits == (1024, 1024)
        reader = Reader(port)
        store.store(list(range(8)), make_kv(8))
        assert any(e["type"] == "BlockStored" for _, b in reader.until_stored() for e in b)
        assert reader.replay(0) is not None
        reader.close()
    finally:
        ctx.destroy(linger=0)
        store.close()


def test_an_overflowing_queue_becomes_a_welcome_not_a_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port_pair()
    monkeypatch.setattr(events_mod, "_MAX_PENDING", 3)
    monkeypatch.setattr(events_mod, "WELCOME_INTERVAL_S", 0.0)
    store = _store(tmp_path / "d", port)
    reader = Reader(port)
    try:
        reader.welcomed()
        assert store.store(list(range(40)), make_kv(40)) == 40  # 10 blocks > 3: the queue overflows
        want = {wire_hash(h) for h in store.block_hashes(list(range(40)))}
        reader.until(lambda events: held(events)["CPU"] | held(events)["DISK"] == want)
        assert store.events is not None and store.events.num_dropped > 0
        seqs = [s for s, _ in reader.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no gap"
        state = held(reader.events())
        assert state["CPU"] | state["DISK"] == want
    finally:
        reader.close()
        store.close()


def test_a_tier_change_log_that_overflowed_is_restated_not_a_gap(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier whose change log overflowed (more changes than it holds before they are taken)
    hands out a RESYNC with what it holds: the publisher restates that tier in its mirror and
    welcomes every reader again, so readers end up knowing exactly what the tiers hold."""
    from tiers import changes as changes_mod

    port = free_port_pair()
    monkeypatch.setattr(changes_mod, "MAX_CHANGED_KEYS", 3)
    monkeypatch.setattr(events_mod, "WELCOME_INTERVAL_S", 0.0)
    store = _store(tmp_path / "d", port)
    reader = Reader(port)
    try:
        reader.welcomed()
        tokens = list(range(40))
        assert store.store(tokens, make_kv(40)) == 40  # 10 blocks: the CPU tier records 8 > 3 at once
        assert store.events is not None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            reader.drain(0.5)
            state = held(reader.events())
            if state["CPU"] and state["DISK"]:
                break
        cpu, disk = ({t.kind: t for t in store.tiers}[TierKind(k)] for k in ("cpu", "disk"))
        assert store.events.num_resyncs >= 1 and cpu.num_changes_dropped >= 8
        assert state["CPU"] == {wire_hash(h) for h in cpu.held_hashes()} and len(state["CPU"]) == 8
        assert state["DISK"] == {wire_hash(h) for h in disk.held_hashes()} and len(state["DISK"]) == 2
    finally:
        reader.close()
        store.close()


def test_endpoints_other_hosts_reach_need_curve_or_an_explicit_insecure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="events_endpoint"):
        StoreConfig(LAYOUT, events_endpoint="http://x:1")
    with pytest.raises(ConfigError, match="events_endpoint"):
        StoreConfig(LAYOUT, events_endpoint="tcp://127.0.0.1:99999")
    with pytest.raises(ConfigError, match="events_insecure"):
        StoreConfig(LAYOUT, events_endpoint="tcp://0.0.0.0:5590")
    with pytest.raises(ConfigError, match="go together"):
        StoreConfig(LAYOUT, events_endpoint="tcp://127.0.0.1:5590", events_curve_cert="x")
    StoreConfig(LAYOUT, events_endpoint="tcp://0.0.0.0:5590", events_insecure=True)
    port = free_port_pair()
    first = _store(tmp_path / "a", port)
    try:
        with pytest.raises(ConfigError, match="cannot be bound"):
            _store(tmp_path / "b", port)
        # the failed open leaked nothing: the directory can be opened again at once
        KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, disk_path=str(tmp_path / "b"), disk_bytes=16 << 20)).close()
    finally:
        first.close()


@pytest.mark.slow
def test_curve_admits_only_the_readers_it_knows(tmp_path: Path) -> None:
    import zmq.auth

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    reader_public, _reader_secret = zmq.auth.create_certificates(str(keys), "reader")
    zmq.auth.create_certificates(str(keys), "stranger")
    os.replace(reader_public, clients / "reader.key")
    port = free_port_pair()
    store = _store(tmp_path / "d", port, events_curve_cert=server_secret, events_curve_clients=str(clients))
    ctx = zmq.Context()
    readers = []
    try:
        for name in ("reader", "stranger"):
            pub, sec = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
            readers.append(Reader(port, ctx, {"curve_publickey": pub, "curve_secretkey": sec,
                                              "curve_serverkey": zmq.auth.load_certificate(server_public)[0]}))
        plain = Reader(port, ctx)
        readers.append(plain)
        time.sleep(0.5)
        store.store(list(range(8)), make_kv(8))
        got = [readers[0].until_stored(), *(r.drain(1.5) for r in readers[1:])]
        assert any(e["type"] == "BlockStored" for _, b in got[0] for e in b)
        assert got[1] == [] and got[2] == [], "an unknown key or no key reads nothing"
        assert readers[0].replay(0) is not None and readers[2].replay(0, timeout_ms=500) is None
    finally:
        for r in readers:
            r.close()
        ctx.destroy(linger=0)
        store.close()


def test_a_store_can_connect_to_a_reader_that_binds(tmp_path: Path) -> None:
    """llm-d's indexer binds and engines connect: with events_connect the store does."""
    port = free_port_pair()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(f"tcp://127.0.0.1:{port}")
    store = _store(tmp_path / "d", port, events_connect=True, events_topic="kv@pod-a@model-x")
    try:
        store.store(list(range(8)), make_kv(8))
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(e["type"] == "BlockStored" for e in seen):
            if sub.poll(100):
                topic, _, payload = sub.recv_multipart()
                assert topic == b"kv@pod-a@model-x"
                seen.extend(msgpack.unpackb(payload)[1])
        assert any(e["type"] == "BlockStored" and e["medium"] == "CPU" for e in seen)
        assert store.events is not None and store.events.config.replay_endpoint is None
    finally:
        store.close()
        sub.close(linger=0)


def test_records_without_a_parent_are_read_but_not_announced(tmp_path: Path) -> None:
    """Records written without KV events (as by an older kvstrata) carry no parent: they still
    verify and load, and a store publishing events counts them instead of announcing them."""
    plain = KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, disk_path=str(tmp_path / "d"),
                                     disk_bytes=16 << 20, disk_sync=False))
    kv = make_kv(8)
    plain.store(list(range(8)), kv)
    plain.close()
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    reader = Reader(port)
    try:
        disk = next(t for t in store.tiers if t.kind.value == "disk")
        assert disk.num_unannounceable == 2  # type: ignore[attr-defined]
        assert not any(e["type"] == "BlockStored" for _, b in reader.drain(1.5) for e in b)
        got = store.retrieve(list(range(8)))
        assert got.num_tokens == 8 and got.kv is not None and got.kv.equal(kv)
    finally:
        reader.close()
        store.close()


def test_damaged_extras_are_not_announced_and_raise_nothing_raw() -> None:
    """Extras read back from a disk may be damaged: decoding them is bounded by their size,
    and a key with extras that do not decode is counted, never announced (nor a raw msgpack
    or type error on the publisher's thread)."""
    from kvevents import BadPayload, vllm_extras
    from kvevents.mirror import Mirror
    from tiers.keys import BlockKey

    damaged = [b"\xdd\xff\xff\xff\xff", msgpack.packb(5), msgpack.packb([["lora"]]), msgpack.packb([[]]),
               msgpack.packb([["salt", "s"]]) + b"\x00", b"\x91" * 2000]
    for extras in damaged:
        with pytest.raises(BadPayload):
            vllm_extras(extras)
    assert vllm_extras(msgpack.packb([["lora", "ad"], ["salt", "s"]])) == ("ad", ["ad", "s"])
    mirror = Mirror(16)
    for i, extras in enumerate(damaged):
        assert mirror.stored(1, BlockKey(bytes([i]) * 32, b"\x01\x00\x00\x00", b"\x00" * 32, extras)) is None
    assert mirror.num_undescribed == len(damaged) and not mirror.blocks


def test_a_reader_subscribing_again_and_again_cannot_make_the_store_broadcast_its_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subscription calls for a welcome, the whole state broadcast to every reader (each
    router then ingests all of it): after one of B bytes, the next waits B / the rate."""
    monkeypatch.setattr(events_mod, "WELCOME_INTERVAL_S", 0.0)
    monkeypatch.setattr(events_mod, "WHOLE_STATE_BYTES_PER_S", 200.0)
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    ctx = zmq.Context()
    xsub = ctx.socket(zmq.XSUB)
    xsub.setsockopt(zmq.LINGER, 0)
    try:
        store.store(list(range(32)), make_kv(32))  # a whole state of more than 200 bytes
        xsub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)
        assert store.events is not None
        before = store.events.num_welcomes
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            xsub.send(b"\x01")  # subscribe again
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        welcomes = store.events.num_welcomes - before
        assert 1 <= welcomes <= 2 + elapsed, welcomes  # each over 200 bytes: at most one a second
        reader = Reader(port)
        store.events.drop_replay_buffer()
        assert reader.replay(0) == [], "a whole-state replay waits its turn too: only the end marker"
        reader.close()
    finally:
        xsub.close(linger=0)
        ctx.term()
        store.close()
