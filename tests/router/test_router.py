"""`kvstrata router` against real store processes over loopback ZeroMQ (vLLM's event format)
and real HTTP: what it reports equals each store's own view, through restarts, evictions, a
shared remote tier and hostile requests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.ports import free_port_pair
from tests import ROOT
from tests.conftest import BLOCK


class Instance:
    """A store process publishing KV events (tests/fleet_instance.py)."""

    def __init__(self, instance_id: str, port: int, disk: Path | None, cpu_blocks: int,
                 remote: str | None = None, namespace: str = "default") -> None:
        self.id, self.port, self.disk, self.cpu_blocks, self.remote = instance_id, port, disk, cpu_blocks, remote
        self.namespace = namespace
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.subscription = f"{instance_id}={self.endpoint},tcp://127.0.0.1:{port + 1}"
        args = [sys.executable, "-m", "tests.fleet_instance", str(port), instance_id, str(disk or ""), str(cpu_blocks),
                remote or "", namespace]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._read() == {"ready": True}

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"instance {self.id} exited ({self.proc.poll()})"
        return json.loads(line)

    def call(self, op: str, tokens: list[int] | None = None, salt: str | None = None) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "tokens": tokens, "salt": salt}) + "\n")
        self.proc.stdin.flush()
        return self._read()["ok"]

    def restart(self) -> Instance:
        self.close()
        return Instance(self.id, self.port, self.disk, self.cpu_blocks, self.remote, self.namespace)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call("close")
            self.proc.wait(timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


class RouterProcess:
    def __init__(self, subscriptions: list[str], *extra: str, token: str | None = None) -> None:
        self.port = free_port_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        args = [sys.executable, "-m", "cli.main", "router", "--port", str(self.port), *extra]
        for subscription in subscriptions:
            args += ["--subscribe", subscription]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: self.get("/healthz")[0] in (200, 503), "router up")

    def request(self, method: str, path: str, body: bytes | None = None,
                token: str | None = None) -> tuple[int, Any]:
        token = token or self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        except (urllib.error.URLError, ConnectionError):
            return 0, None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def lookup(self, tokens: list[int], **fields: Any) -> dict[str, Any]:
        status, body = self.request("POST", "/lookup", json.dumps({"token_ids": tokens, **fields}).encode())
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def wait_for(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def doc(seed: int, num_blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(num_blocks * BLOCK)]


def by_tier(where: list[str]) -> dict[str, int]:
    counts = Counter(where)
    return {t: counts.get(t, 0) * BLOCK for t in ("pool", "cpu", "disk", "remote")}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def start(instance_id: str, *, cpu_blocks: int = 8, disk: bool = True, port: int | None = None,
              remote: str | None = None, namespace: str = "default") -> Instance:
        inst = Instance(instance_id, port or free_port_pair(), tmp_path / instance_id if disk else None, cpu_blocks,
                        remote, namespace)
        made.append(inst)
        return inst

    yield start
    for inst in made:
        if inst.proc.poll() is None:
            inst.kill()


@pytest.fixture
def routers() -> Iterator[Callable[..., RouterProcess]]:
    made: list[RouterProcess] = []

    def start(subscriptions: list[str], *extra: str, token: str | None = None) -> RouterProcess:
        router = RouterProcess(subscriptions, *extra, token=token)
        made.append(router)
        return router

    yield start
    for router in made:
        if router.proc.poll() is None:
            router.stop()


def expect(router: RouterProcess, tokens: list[int], truth: dict[str, list[str]], **fields: Any) -> dict[str, Any]:
    """Wait until the router's per-tier counts equal each instance's own view; return the answer."""
    last: dict[str, Any] = {}

    def matches() -> bool:
        nonlocal last
        last = router.lookup(tokens, **fields)
        return all(iid in last["instances"] and last["instances"][iid]["by_tier"] == by_tier(where)
                   for iid, where in truth.items())

    try:
        wait_for(matches, "the router to agree with the instances")
    except AssertionError:
        raise AssertionError(f"router: {last}; instances: {truth}") from None
    return last


def test_lookup_names_the_instance_with_the_longest_prefix_and_its_tiers(fleet: Any, routers: Any) -> None:
    a, b = fleet("a", cpu_blocks=6), fleet("b", cpu_blocks=64)
    router = routers([a.subscription, b.subscription])
    long_doc, short_doc = doc(1, 10), doc(2, 3)
    a.call("store", long_doc)  # 10 blocks into 6 CPU slots: 4 demoted to disk
    b.call("store", long_doc[: 4 * BLOCK])  # b holds the first 4 blocks, in memory
    b.call("store", short_doc)
    truth = {"a": a.call("where", long_doc), "b": b.call("where", long_doc)}
    assert Counter(truth["a"]) == {"cpu": 6, "disk": 4} and truth["b"] == ["cpu"] * 4
    answer = expect(router, long_doc, truth)
    assert answer["best"] == "a" and answer["instances"]["a"]["matched_tokens"] == 10 * BLOCK
    answer = expect(router, short_doc + doc(9, 2), {"a": [], "b": b.call("where", short_doc)})
    assert answer["best"] == "b" and answer["instances"]["b"]["matched_tokens"] == 3 * BLOCK
    # other keys are other blocks: a salted query matches nothing
    salted = router.lookup(long_doc, cache_salt="tenant-x")
    assert all(v["matched_tokens"] == 0 for v in salted["instances"].values())
    # a load signal moves an equal-prefix request off the busy instance
    both = long_doc[: 4 * BLOCK]
    assert router.lookup(both, load={"b": 5})["best"] == "a"
    assert router.lookup(both, load={"a": 5})["best"] == "b"
    status, text = router.get("/metrics")
    assert status == 200 and "kvstrata_router_lookups_total" in text and 'state="alive"} 2' in text
    # a salted sequence is matched only with its salt
    b.call("store", doc(3, 2), salt="tenant-y")
    assert expect(router, doc(3, 2), {"b": ["cpu"] * 2}, cache_salt="tenant-y")["best"] == "b"
    assert router.lookup(doc(3, 2))["instances"]["b"]["matched_tokens"] == 0


def test_late_router_and_restarted_router_rebuild_from_snapshots(fleet: Any, routers: Any) -> None:
    a, b = fleet("a"), fleet("b")
    docs = [doc(i, 3) for i in range(4)]
    for i, d in enumerate(docs):
        (a if i % 2 == 0 else b).call("store", d)
    truth = {d_i: {"a": a.call("where", d), "b": b.call("where", d)} for d_i, d in enumerate(docs)}
    router = routers([a.subscription, b.subscription])  # joins after everything was stored
    t0 = time.monotonic()
    for i, d in enumerate(docs):
        assert expect(router, d, truth[i])["best"] == ("a" if i % 2 == 0 else "b")
    first = time.monotonic() - t0
    router.stop()
    router = routers([a.subscription, b.subscription])
    t0 = time.monotonic()
    for i, d in enumerate(docs):
        assert expect(router, d, truth[i])["best"] == ("a" if i % 2 == 0 else "b")
    assert first < 10 and time.monotonic() - t0 < 10, "a router rebuilds its view within seconds"


@pytest.mark.slow
def test_restarted_instance_announces_its_warm_disk_and_evictions_show(fleet: Any, routers: Any) -> None:
    a = fleet("a", cpu_blocks=4)
    router = routers([a.subscription])
    first = doc(1, 4)
    a.call("store", first)
    expect(router, first, {"a": ["cpu"] * 4})
    a = a.restart()  # close() persists the CPU tier; the new process starts with a warm disk
    truth = a.call("where", first)
    assert truth == ["disk"] * 4
    expect(router, first, {"a": truth})
    # an instance without a disk: what its CPU tier evicts leaves the index
    c = fleet("c", cpu_blocks=4, disk=False)
    router2 = routers([c.subscription])
    c.call("store", first)
    expect(router2, first, {"c": ["cpu"] * 4})
    c.call("store", doc(2, 4))  # evicts all of `first`
    expect(router2, first, {"c": []})
    expect(router2, doc(2, 4), {"c": ["cpu"] * 4})


def discard_from_disk(disk: Path, tokens: list[int]) -> None:
    """Another process evicts the blocks of `tokens` from a store's disk while it is down."""
    from kvstore import KVCacheStore, StoreConfig
    from tests.conftest import LAYOUT

    store = KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, disk_path=str(disk),
                                     disk_bytes=16 << 20, disk_sync=False))
    try:
        disk_tier = next(t for t in store.tiers if t.kind.value == "disk")
        assert disk_tier.discard(store.block_hashes(tokens)) == len(tokens) // BLOCK
    finally:
        store.close()


def test_a_restarted_store_makes_the_router_forget_what_its_disk_lost(fleet: Any, routers: Any,
                                                                         tmp_path: Path) -> None:
    """A store announces blocks and stops; another process evicts some from its disk; it
    restarts (its batch numbers continue above the last lifetime's, its epoch is new): the
    router no longer shows the evicted blocks and still shows the rest."""
    a = fleet("a", cpu_blocks=4)
    router = routers([a.subscription])
    gone, kept = doc(1, 4), doc(2, 4)
    a.call("store", gone)
    a.call("store", kept)
    expect(router, gone, {"a": a.call("where", gone)})
    expect(router, kept, {"a": a.call("where", kept)})
    a.close()
    discard_from_disk(tmp_path / "a", gone)
    a = fleet("a", cpu_blocks=4, port=a.port)  # the same endpoint, over the same disk
    assert a.call("where", gone) == [] and a.call("where", kept) == ["disk"] * 4
    expect(router, gone, {"a": []})
    expect(router, kept, {"a": ["disk"] * 4})


def test_a_dead_instance_stops_being_a_candidate(fleet: Any, routers: Any) -> None:
    a, b = fleet("a"), fleet("b")
    router = routers([a.subscription, b.subscription], "--stale-after", "2")
    d = doc(1, 3)
    a.call("store", d)
    assert expect(router, d, {"a": ["cpu"] * 3})["best"] == "a"
    a.kill()
    wait_for(lambda: "a" not in router.lookup(d)["instances"], "the dead instance to drop out")
    assert router.lookup(d)["best"] == "b"


def test_malformed_requests_get_a_clear_4xx_and_the_router_lives_on(fleet: Any, routers: Any) -> None:
    a = fleet("a")
    router = routers([a.subscription])
    cases = [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"token_ids": [1, "2"]}).encode(), 400, "integers"),
        (json.dumps({"token_ids": [1, -1]}).encode(), 400, "integers"),
        (json.dumps({"token_ids": [1, 2**40]}).encode(), 400, "integers"),
        (json.dumps({"token_ids": [True]}).encode(), 400, "integers"),
        (json.dumps({"token_ids": "1 2 3"}).encode(), 400, "list"),
        (json.dumps({"tokens": [1]}).encode(), 400, "unknown fields"),
        (json.dumps({"token_ids": [1], "cache_salt": 5}).encode(), 400, "cache_salt"),
        (json.dumps({"token_ids": [1], "load": {"a": -1}}).encode(), 400, "load"),
        (b'{"token_ids": [1], "load": {"a": 1' + b"0" * 400 + b"}}", 400, "load"),  # a 401-digit number
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        (b"[" + b"1," * (9 << 20) + b"1]", 413, "larger than"),
    ]
    for body, status, message in cases:
        got, answer = router.request("POST", "/lookup", body)
        assert got == status and message in answer["error"], (body[:40], got, answer)
    assert router.request("GET", "/lookup")[0] == 405
    assert router.get("/nowhere")[0] == 404
    assert router.get("/healthz")[0] == 200 and router.proc.poll() is None
    assert "kvstrata_router_bad_requests_total 13" in router.get("/metrics")[1]


def test_bad_command_lines_are_one_line_errors() -> None:
    cases = [(["--subscribe", "http://x"], "--subscribe"), (["--port", "0"], "--port"),
             (["--host", "0.0.0.0"], "--token-file"), (["--control", "a=https://h:1"], "--control"),
             (["--control", "http://h:1"], "--control")]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-m", "cli.main", "router", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr


def test_a_port_in_use_is_one_line_and_nothing_claims_to_listen(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "cli.main", "router", "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen" in lines[0] and str(port) in lines[0], proc.stderr
    assert "listening" not in proc.stderr and "http://" not in proc.stderr


def test_instances_register_over_http_with_the_token(fleet: Any, routers: Any, tmp_path: Path) -> None:
    token = "s3cret-token-of-the-router"
    (tmp_path / "token").write_text(token + "\n")
    router = routers([], "--token-file", str(tmp_path / "token"), token=token)
    assert router.get("/healthz")[0] == 503  # knows no instance: not ready
    a = fleet("a")
    body = json.dumps({"instance_id": "a", "endpoint": a.endpoint, "replay_endpoint": f"tcp://127.0.0.1:{a.port + 1}",
                       "model_name": "m", "block_size": BLOCK}).encode()
    assert router.request("POST", "/register", body, token="wrong-token-wrong-token")[0] == 401
    assert router.request("POST", "/lookup", b'{"token_ids": []}', token="wrong-token-wrong-token")[0] == 401
    assert router.request("POST", "/register", body)[0] == 200
    wait_for(lambda: router.get("/healthz")[0] == 200, "ready once an instance is known")
    d = doc(1, 3)
    a.call("store", d)
    assert expect(router, d, {"a": ["cpu"] * 3}, model="m")["best"] == "a"
    assert router.lookup(d, model="other")["best"] is None
    status, answer = router.request("POST", "/register", json.dumps({"endpoint": "http://x"}).encode())
    assert status == 400 and "endpoint" in answer["error"]
    assert router.request("POST", "/unregister", json.dumps({"instance_id": "a"}).encode())[0] == 200
    assert router.get("/healthz")[0] == 503 and router.lookup(d)["instances"] == {}


def test_a_shared_remote_tier_counts_for_every_instance_that_reads_it(fleet: Any, routers: Any) -> None:
    from tests.redis_fixtures import redis_server

    with redis_server() as server:
        a = fleet("a", disk=False, remote=server.url)
        b = fleet("b", disk=False, remote=server.url)
        c = fleet("c", disk=False)  # no remote tier
        router = routers([a.subscription, b.subscription, c.subscription])
        d = doc(1, 3)
        a.call("store", d)
        a.call("flush")
        assert b.call("where", d) == ["remote"] * 3  # b reads a's blocks through the server
        answer = expect(router, d, {"a": ["cpu"] * 3, "b": ["remote"] * 3, "c": []})
        assert answer["best"] == "a"


def test_one_models_clear_leaves_another_models_remote_blocks(fleet: Any, routers: Any) -> None:
    """Two models on one remote server: clearing one empties its own slot only."""
    from cli.redis_servers import redis_server

    with redis_server() as server:
        a = fleet("a", disk=False, cpu_blocks=2, remote=server.url, namespace="model-x")
        b = fleet("b", disk=False, cpu_blocks=2, remote=server.url, namespace="model-y")
        router = routers([a.subscription, b.subscription])
        d = doc(1, 3)  # 3 blocks into 2 CPU slots: the remote tier holds all 3
        for inst in (a, b):
            inst.call("store", d)
            inst.call("flush")
        truth = {"a": a.call("where", d), "b": b.call("where", d)}
        assert truth["a"] == truth["b"] == ["cpu", "cpu", "remote"]
        expect(router, d, truth)
        a.call("clear")
        expect(router, d, {"a": [], "b": b.call("where", d)})


def test_a_source_claiming_anothers_remote_tier_cannot_clear_it(fleet: Any, routers: Any) -> None:
    """The remote tier's identity and namespace fingerprint are in every store's events: a
    hostile source claiming both and clearing the shared tier (and removing its blocks by
    the hashes it read) takes only what it announced itself, nothing of the victims'."""
    import msgpack
    import zmq

    from tests.redis_fixtures import redis_server

    ctx = zmq.Context()
    evil = ctx.socket(zmq.XPUB)
    evil.setsockopt(zmq.LINGER, 0)
    evil_port = free_port_pair()
    evil.bind(f"tcp://127.0.0.1:{evil_port}")
    spy = ctx.socket(zmq.SUB)
    spy.setsockopt(zmq.LINGER, 0)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with redis_server() as server:
            a = fleet("a", disk=False, cpu_blocks=16, remote=server.url)
            b = fleet("b", disk=False, remote=server.url)
            router = routers([a.subscription, b.subscription, f"evil=tcp://127.0.0.1:{evil_port}"])
            spy.connect(a.endpoint)
            d = doc(1, 16)  # 64 tokens
            a.call("store", d)
            a.call("flush")
            assert b.call("where", d) == ["remote"] * 16
            expect(router, d, {"a": ["cpu"] * 16, "b": ["remote"] * 16})
            meta: dict[str, Any] = {}
            hashes: list[int] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (meta and len(hashes) >= 16):  # what any reader sees
                if spy.poll(200):
                    for event in msgpack.unpackb(spy.recv_multipart()[2])[1]:
                        meta = event["kvstrata"]
                        if event["type"] == "BlockStored" and event["medium"] == "SHARED":
                            hashes += event["block_hashes"]
            assert meta.get("remote") and meta.get("ns") and len(hashes) >= 16
            assert evil.poll(20_000)
            evil.recv()
            claims = [{"type": "AllBlocksCleared", "kvstrata": {**meta, "media": ["SHARED"]}},
                      {"type": "BlockRemoved", "block_hashes": hashes, "medium": "SHARED", "kvstrata": meta},
                      {"type": "AllBlocksCleared", "kvstrata": {**meta, "epoch": 7, "media": None}}]
            for seq, event in enumerate(claims):
                evil.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), [event], 0])])
            wait_for(lambda: router.get("/instances")[1].get("evil", {}).get("sources", [{}])[0].get("seq") == 2,
                     "the router to take the hostile batches")
            answer = router.lookup(d)
            assert answer["instances"]["b"]["by_tier"] == by_tier(["remote"] * 16), answer
            assert answer["instances"]["a"]["by_tier"] == by_tier(["cpu"] * 16), answer
    finally:
        spy.close(linger=0)
        evil.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_demo_fleet_router_placement_beats_round_robin(tmp_path: Path) -> None:
    env_results = {"KVSTRATA_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "demo-fleet", "--engines", "2", "--docs", "3",
                           "--questions", "3", "--doc-tokens", "256"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, **env_results})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "demo_fleet.json").read_text())
    assert result["router"]["same_answers"] and result["round-robin"]["same_answers"]
    assert result["router"]["hit_rate"] > result["round-robin"]["hit_rate"]
    assert result["router"]["hit_rate"] == pytest.approx(result["ceiling_hit_rate"]), result
