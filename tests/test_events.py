"""KV events of a store: real ZeroMQ sockets on loopback, decoded as a router would."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from bench.ports import free_port_pair
from kvstore import KVCacheStore, StoreConfig
from kvstore import events as events_mod
from kvstore.errors import ConfigError
from kvstore.events import EventSource, snapshot_endpoint, split_hashes
from tests.conftest import BLOCK, LAYOUT, make_kv


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, events_mod.TOPIC)
        self.sub.connect(endpoint)
        self.batches: list[tuple[int, dict[str, Any]]] = []

    def drain(self, seconds: float) -> list[tuple[int, dict[str, Any]]]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == events_mod.TOPIC
                self.batches.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        return self.batches

    def events(self) -> list[tuple[str, str, list[bytes]]]:
        return [(op, tier, split_hashes(blob, 16) if blob else [])
                for _, b in self.batches for op, tier, blob in b["ev"]]

    def snapshot(self) -> tuple[int, dict[str, Any]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(snapshot_endpoint(self.endpoint))
        dealer.send(b"snapshot")
        assert dealer.poll(5000), "no snapshot reply"
        tag, seq, payload = dealer.recv_multipart()
        dealer.close()
        assert tag == b"snapshot"
        return int.from_bytes(seq, "big"), msgpack.unpackb(payload)

    def close(self) -> None:
        self.sub.close(linger=0)


def _store(path: Path, port: int, *, cpu_blocks: int = 8, **kw: Any) -> KVCacheStore:
    return KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK),
                                    disk_path=str(path), disk_bytes=16 << 20, disk_sync=False,
                                    events_endpoint=f"tcp://127.0.0.1:{port}", instance_id="inst-a", **kw))


def test_events_name_each_tier_and_follow_evictions(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port, cpu_blocks=4)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before it connects (the snapshot covers that)
        tokens = list(range(24))  # 6 blocks: 4 stay in the CPU tier, the oldest 2 are demoted to disk
        store.store(tokens, make_kv(24))
        hashes = store.block_hashes(tokens)
        sub.drain(1.5)
        seqs = [s for s, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers must count batches"
        src = EventSource.from_wire(sub.batches[-1][1]["src"])
        assert (src.instance_id, src.seed, src.block_size, src.algo) == ("inst-a", bytes(store.seed), BLOCK,
                                                                          "xxh3_128")
        held: dict[str, set[bytes]] = {"cpu": set(), "disk": set()}
        for op, tier, hs in sub.events():
            (held[tier].update if op == "stored" else held[tier].difference_update)(hs)
        plan = store.stack.locate(hashes)
        truth = {"cpu": {h for h, t in zip(hashes, plan) if store.tiers[t].kind.value == "cpu"},
                 "disk": set(hashes) - {h for h, t in zip(hashes, plan) if store.tiers[t].kind.value == "cpu"}}
        assert held["cpu"] == truth["cpu"] and len(truth["cpu"]) == 4
        assert truth["disk"] <= held["disk"] and len(truth["disk"]) == 2
    finally:
        sub.close()
        store.close()


def test_snapshot_announces_a_warm_disk_after_restart(tmp_path: Path) -> None:
    port = free_port_pair()
    store = _store(tmp_path / "d", port)
    tokens = list(range(16))
    store.store(tokens, make_kv(16))
    hashes = set(store.block_hashes(tokens))
    store.close()  # persists the CPU tier to disk
    store = _store(tmp_path / "d", port)  # a restarted instance: empty memory, warm disk
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        seq, snap = sub.snapshot()
        assert set(split_hashes(snap["tiers"]["disk"], 16)) == hashes
        assert snap["tiers"]["cpu"] == b""
        assert seq >= 0 and snap["src"]["id"] == "inst-a"
    finally:
        sub.close()
        store.close()


def test_an_overflowing_queue_is_a_gap_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port_pair()
    monkeypatch.setattr(events_mod, "_MAX_PENDING", 3)
    store = _store(tmp_path / "d", port)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)
        sub.drain(1.2)
        before = sub.batches[-1][0]
        assert store.store(list(range(40)), make_kv(40)) == 40  # 10 blocks > 3: the events are dropped
        sub.drain(1.5)
        assert store.events is not None and store.events.num_dropped > 0
        after = [s for s, _ in sub.batches if s > before]
        assert after and after[0] > before + 1, "a dropped batch must leave a gap in the sequence"
    finally:
        sub.close()
        store.close()


def test_bad_and_taken_endpoints_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="events_endpoint"):
        StoreConfig(LAYOUT, events_endpoint="http://x:1")
    with pytest.raises(ConfigError, match="events_endpoint"):
        StoreConfig(LAYOUT, events_endpoint="tcp://127.0.0.1:99999")
    port = free_port_pair()
    first = _store(tmp_path / "a", port)
    try:
        with pytest.raises(ConfigError, match="cannot be bound"):
            _store(tmp_path / "b", port)
        # the failed open leaked nothing: the directory can be opened again at once
        KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, disk_path=str(tmp_path / "b"), disk_bytes=16 << 20)).close()
    finally:
        first.close()
