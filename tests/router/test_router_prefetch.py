"""`POST /prefetch` on a real `kvstrata router` (real HTTP, real KV events over loopback
ZeroMQ) forwarding to real control listeners (`engine_adapter/control.py`) on real stores
with disk tiers: it reaches the instance `/lookup` chooses, with the router's token, and that
instance's CPU tier is warmed; a dead, silent or unknown control listener is a counted 502,
504 or 409; a bad body or control URL is a 400 naming it."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cli.ports import free_port, free_port_pair
from engine_adapter.control import ControlListener
from kvstore import ConfigError, KVCacheStore, StoreConfig
from router.config import RouterConfig, Subscription
from router.prefetch import check_control_url, parse_control
from router.thread import RouterThread
from tests.conftest import BLOCK, LAYOUT, make_kv
from tests.http_json import post_json
from tiers.keys import TierKind

TOKEN = "the-router-and-its-instances-token"
WAIT_S = 20.0


def http(url: str, body: object, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    return post_json(url, body, token=token)


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def held(router: RouterThread, name: str, tokens: list[int]) -> bool:
    """Whether the router's `/lookup` shows `name` holding all of `tokens` (not a tie's turn)."""
    answer = http(f"{router.url}/lookup", {"token_ids": tokens})[1]
    return bool(answer["instances"].get(name, {}).get("matched_tokens") == len(tokens))


class Instance:
    """A store publishing KV events under `name`, its CPU tier holding 8 blocks over a disk."""

    def __init__(self, name: str, path: Path) -> None:
        port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.subscription = Subscription(self.endpoint, name, f"tcp://127.0.0.1:{port + 1}")
        self.store = KVCacheStore(StoreConfig(
            LAYOUT, block_size=BLOCK, cpu_bytes=8 * LAYOUT.block_bytes(BLOCK), disk_path=str(path),
            disk_bytes=16 << 20, disk_sync=False, events_endpoint=self.endpoint, instance_id=name))
        self.control = ControlListener(self.store, token=TOKEN).start()


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Instance, Instance]]:
    a, b = Instance("a", tmp_path / "a"), Instance("b", tmp_path / "b")
    yield a, b
    for inst in (a, b):
        inst.control.close()
        inst.store.close()


PROMPT = list(range(5, 5 + 6 * BLOCK))
FILLER = list(range(9000, 9000 + 8 * BLOCK))


def test_prefetch_reaches_the_instance_lookup_chooses_and_warms_its_cpu_tier(two: tuple[Instance, Instance]) -> None:
    a, b = two
    a.store.store(PROMPT, make_kv(len(PROMPT), seed=1))
    a.store.store(FILLER, make_kv(len(FILLER), seed=2))  # the CPU tier holds 8 blocks: the prompt goes to disk
    assert a.store.locate(PROMPT) == [TierKind.DISK] * 6
    # a's control URL comes from /register, b's from the router's configuration (--control).
    router = RouterThread(RouterConfig(subscriptions=(b.subscription,), token=TOKEN,
                                       controls=(("b", b.control.url),)))
    try:
        registered = {"instance_id": "a", "endpoint": a.endpoint, "replay_endpoint": a.subscription.replay,
                      "control_url": a.control.url}
        assert http(f"{router.url}/register", registered)[0] == 200
        wait_for(lambda: held(router, "a", PROMPT), "a's events")
        status, answer = http(f"{router.url}/prefetch", {"token_ids": PROMPT, "wait_s": 10})
        assert status == 200, answer
        assert answer["instance"] == "a" and answer["forwarded_to"] == f"{a.control.url}/prefetch"
        assert answer["instance_status"] == 200 and answer["instance_answer"]["num_promoted"] == 6, answer
        assert a.store.locate(PROMPT) == [TierKind.CPU] * 6
        assert b.control.counters["requests"] == 0 and a.control.counters["accepted"] == 1
        assert router.call(lambda: router.router.forwarder.num_forwarded) == 1
        # What b holds is forwarded to b (its static control URL), unsalted keys only.
        b.store.store(FILLER[: 2 * BLOCK], make_kv(2 * BLOCK, seed=3))
        wait_for(lambda: held(router, "b", FILLER[: 2 * BLOCK]), "b's events")
        status, answer = http(f"{router.url}/prefetch", {"token_ids": FILLER[: 2 * BLOCK], "load": {"a": 100}})
        assert (status, answer["instance"], answer["instance_status"]) == (200, "b", 202), answer
        # A wrong router token reaches nobody.
        assert http(f"{router.url}/prefetch", {"token_ids": PROMPT}, token="x" * 20)[0] == 401
        assert a.control.counters["unauthorized"] == 0
    finally:
        router.stop()


def _silent_listener() -> tuple[socket.socket, str]:
    """A socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_dead_silent_and_missing_control_listeners_are_counted_errors(two: tuple[Instance, Instance]) -> None:
    a, b = two
    a.store.store(PROMPT, make_kv(len(PROMPT), seed=1))
    silent, silent_url = _silent_listener()
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = RouterThread(RouterConfig(subscriptions=(a.subscription, b.subscription), token=TOKEN,
                                       controls=(("a", dead_url),)))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    try:
        router.call(lambda: setattr(router.router.forwarder, "timeout_s", 0.5))
        wait_for(lambda: held(router, "a", PROMPT), "a's events")
        status, answer = http(f"{router.url}/prefetch", {"token_ids": PROMPT})
        assert (status, answer["instance"]) == (502, "a") and "failed" in answer["error"], answer
        router.call(lambda: router.router.controls.update(a=silent_url))
        status, answer = http(f"{router.url}/prefetch", {"token_ids": PROMPT})
        assert status == 504 and "did not answer" in answer["error"], answer
        router.call(lambda: router.router.controls.pop("a"))
        status, answer = http(f"{router.url}/prefetch", {"token_ids": PROMPT})
        assert (status, answer["instance"]) == (409, "a"), answer
        for body, name in (({"token_ids": PROMPT, "lora_id": 3}, "lora_id"), ({"token_ids": "x"}, "token_ids"),
                           ({"token_ids": PROMPT, "wait_s": 60}, "wait_s"),
                           ({"token_ids": PROMPT, "prompt_token_ids": PROMPT}, "unknown fields")):
            status, answer = http(f"{router.url}/prefetch", body)
            assert status == 400 and name in answer["error"], (body, answer)
        bad = {"instance_id": "c", "endpoint": "tcp://127.0.0.1:9", "control_url": "http://user:pw@127.0.0.1:9/x"}
        status, answer = http(f"{router.url}/register", bad)
        assert status == 400 and "control_url" in answer["error"], answer
        forwarder = router.router.forwarder
        counts = router.call(lambda: (forwarder.num_failed, forwarder.num_timeouts, forwarder.num_no_control))
        assert counts == (1, 1, 1)
        metrics = urllib.request.urlopen(urllib.request.Request(
            f"{router.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=10).read().decode()
        assert "kvstrata_router_prefetch_timeouts_total 1.0" in metrics
    finally:
        router.stop()
        silent.close()
        for sock in accepted:
            sock.close()


def test_forwards_waiting_on_their_instances_are_bounded(two: tuple[Instance, Instance]) -> None:
    """Past `max_in_flight` forwards waiting on instances (each holding its parsed body for
    up to the timeout), one more is a counted 429 at once, never another waiter."""
    a, b = two
    a.store.store(PROMPT, make_kv(len(PROMPT), seed=1))
    silent, silent_url = _silent_listener()
    router = RouterThread(RouterConfig(subscriptions=(a.subscription, b.subscription), token=TOKEN,
                                       controls=(("a", silent_url),)))
    forwarder = router.router.forwarder
    try:
        router.call(lambda: (setattr(forwarder, "timeout_s", 4.0), setattr(forwarder, "max_in_flight", 2)))
        wait_for(lambda: held(router, "a", PROMPT), "a's events")
        waiting: list[int] = []
        threads = [threading.Thread(target=lambda: waiting.append(http(f"{router.url}/prefetch",
                                                                       {"token_ids": PROMPT})[0]))
                   for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: router.call(lambda: forwarder.in_flight) == 2, "two forwards waiting")
        status, answer = http(f"{router.url}/prefetch", {"token_ids": PROMPT})
        assert status == 429 and "wait" in answer["error"], answer
        for t in threads:
            t.join(WAIT_S)
        assert waiting == [504, 504]
        assert router.call(lambda: (forwarder.num_busy, forwarder.num_timeouts, forwarder.in_flight)) == (1, 2, 0)
    finally:
        router.stop()
        silent.close()


def test_an_instance_answering_json_too_deep_to_read_is_a_counted_502(two: tuple[Instance, Instance]) -> None:
    """A control URL whose server answers 200 with JSON nested past the parser's recursion
    limit (within the answer's byte bound) is a failed forward (502, counted), never a 500."""
    a, b = two
    a.store.store(PROMPT, make_kv(len(PROMPT), seed=1))

    class Deep(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server calls it by this name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b"[" * 30000 + b"]" * 30000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Deep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router = RouterThread(RouterConfig(subscriptions=(a.subscription, b.subscription), token=TOKEN,
                                       controls=(("a", f"http://127.0.0.1:{server.server_address[1]}"),)))
    try:
        wait_for(lambda: held(router, "a", PROMPT), "a's events")
        status, answer = http(f"{router.url}/prefetch", {"token_ids": PROMPT})
        assert (status, answer["instance"]) == (502, "a") and "failed" in answer["error"], answer
        assert router.call(lambda: router.router.forwarder.num_failed) == 1
    finally:
        router.stop()
        server.shutdown()
        server.server_close()


def test_control_urls_are_http_host_port_only() -> None:
    assert check_control_url("http://127.0.0.1:8200/") == "http://127.0.0.1:8200"
    assert check_control_url("http://[::1]:8200") == "http://[::1]:8200"
    assert parse_control("a=http://h:1") == ("a", "http://h:1")
    for bad in ("https://h:1", "http://h", "http://h:1/prefetch", "http://u:p@h:1", "http://h:1?x=1", "h:1",
                "http://h:99999", 5, "http://" + "h" * 600 + ":1"):
        with pytest.raises(ConfigError):
            check_control_url(bad)
    with pytest.raises(ConfigError, match="--control"):
        parse_control("http://h:1")
    with pytest.raises(ConfigError, match="control URL of 'a'"):
        RouterConfig(controls=(("a", "ftp://h:1"),))
