"""The router's HTTP surface under bytes no well-behaved client sends: headers that are not
UTF-8, odd `Expect` headers, bodies whose Content-Encoding does not decode, text fields that
are not UTF-8. Raw requests over a real socket to a running router (aiohttp's own client
refuses to send most of them); every answer is a 4xx, counted, with no traceback logged."""

from __future__ import annotations

import gzip
import json
import logging
import socket
from collections.abc import Iterator

import pytest

from router.config import RouterConfig
from router.thread import RouterThread

TOKEN = "s3cret-token-of-the-router"


@pytest.fixture
def served(caplog: pytest.LogCaptureFixture) -> Iterator[RouterThread]:
    caplog.set_level(logging.WARNING)
    router = RouterThread(RouterConfig(token=TOKEN))
    yield router
    router.stop()
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


def send(router: RouterThread, method: bytes, path: bytes, headers: list[bytes],
         body: bytes = b"") -> tuple[int, bytes]:
    """One request of raw bytes; the answer's status and body."""
    head = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close",
            b"Content-Length: %d" % len(body), *headers]
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    answer = answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def bearer(value: bytes) -> bytes:
    return b"Authorization: " + value


def test_an_authorization_header_that_is_not_utf8_is_a_counted_401(served: RouterThread,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    bad = [b"Bearer \xff\xfe\xfd", b"\xc3\x28", b"Bearer " + TOKEN.encode() + b"\xff", b"\xed\xa0\x80", b"\x80" * 4000]
    for value in bad:
        for method, path in ((b"POST", b"/lookup"), (b"GET", b"/instances"), (b"POST", b"/register")):
            status, body = send(served, method, path, [bearer(value)], b'{"token_ids": [1]}')
            assert status == 401 and b"unauthorized" in body, (value[:20], path, status, body[:200])
    assert served.call(lambda: served.router.num_unauthorized) == 3 * len(bad)
    refused = [r.getMessage() for r in caplog.records if "without the right bearer token" in r.getMessage()]
    assert refused and "kvstrata router" in refused[0] and "127.0.0.1" in refused[0]  # counted and never silent
    status, body = send(served, b"GET", b"/metrics", [bearer(b"Bearer " + TOKEN.encode())])
    assert status == 200 and f"kvstrata_router_unauthorized_total {3.0 * len(bad)}".encode() in body
    assert send(served, b"POST", b"/lookup", [bearer(b"Bearer " + TOKEN.encode())], b'{"token_ids": [1]}')[0] == 200


def test_other_odd_headers_and_bodies_are_4xx_and_counted(served: RouterThread) -> None:
    auth = bearer(b"Bearer " + TOKEN.encode())
    cases: list[tuple[bytes, bytes, list[bytes], bytes, int, bytes]] = []
    for path in (b"/lookup", b"/healthz", b"/nowhere", b"/%ff"):
        for value in (b"\xff\xfe", b"nothing-like-100-continue"):  # aiohttp's own 417 quoted it: a 500 on \xff
            cases.append((b"POST", path, [auth, b"Expect: " + value], b"{}", 417, b"100-continue"))
    cases += [
        (b"POST", b"/lookup", [auth, b"Content-Encoding: gzip"], b'{"token_ids": [1]}', 400, b"cannot be read"),
        (b"POST", b"/lookup", [auth, b"Content-Encoding: deflate"], b"\x00" * 64, 400, b"cannot be read"),
        (b"POST", b"/lookup", [auth], b'{"token_ids": [1], "cache_salt": "\\udcff"}', 400, b"cache_salt"),
        (b"POST", b"/lookup", [auth], b"\xff\xfe\xfd", 400, b"not JSON"),
        (b"POST", b"/register", [auth], b'{"endpoint": "tcp://127.0.0.1:9", "server_public_key": "\\ud800"}',
         400, b"server_public_key"),
        (b"POST", b"/register", [auth], b'{"endpoint": "tcp://127.0.0.1:9", "model_name": "\\ud800"}', 400,
         b"model_name"),
        (b"POST", b"/register", [auth], b'{"endpoint": "tcp://127.0.0.1:9", "instance_id": ["a"]}', 400,
         b"instance_id"),
        (b"POST", b"/unregister", [auth], b'{"endpoint": 5}', 400, b"unregister takes"),
    ]
    for method, path, headers, body, want, message in cases:
        status, answer = send(served, method, path, headers, body)
        assert status == want and message in answer, (path, headers[-1], body[:40], status, answer[:200])
    assert served.call(lambda: served.router.num_bad_requests) == len(cases)
    # what these did not do: break what follows, or reject what is fine
    odd_but_fine = [auth, b"Content-Type: application/json; charset=\xff", b"User-Agent: \xff\xfe",
                    b"X-Forwarded-For: \xc3\x28", b"Content-Encoding: gzip"]
    status, answer = send(served, b"POST", b"/lookup?q=%ff&r=%00", odd_but_fine, gzip.compress(b'{"token_ids": [1]}'))
    assert status == 200 and json.loads(answer)["best"] is None
    assert send(served, b"POST", b"/lookup", [auth, b"Expect: 100-Continue"], b'{"token_ids": [1]}')[0] == 200
    assert send(served, b"GET", b"/lookup", [auth])[0] == 405
    assert send(served, b"HEAD", b"/healthz", [])[0] == 503  # no instances yet; HEAD answers as GET does


def test_requests_the_http_parser_refuses_are_counted_400s_without_a_traceback(served: RouterThread) -> None:
    """aiohttp answers these 400 before any handler runs; the router counts each as a bad
    request and logs one line, never aiohttp's traceback (the fixture checks the log)."""
    auth = bearer(b"Bearer " + TOKEN.encode())
    malformed = [[auth, b"X-Bad\x01Name: 1"], [auth, b"Host: 127.0.0.2"], [auth, b"Bad Header Without Colon"]]
    for headers in malformed:
        status, _ = send(served, b"POST", b"/lookup", headers, b'{"token_ids": [1]}')
        assert status == 400, headers
    assert served.call(lambda: served.router.num_bad_requests) == len(malformed)
    assert send(served, b"POST", b"/lookup", [auth], b'{"token_ids": [1]}')[0] == 200


def _non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback (the route out), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the source address
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_a_register_from_another_host_without_a_token_is_a_counted_and_logged_401(
        caplog: pytest.LogCaptureFixture) -> None:
    """Without a token only loopback clients may register: one from another address is a 401,
    counted and logged in a rate-limited warning naming the client's address (before, only
    the counter saw it), while a lookup from it is served."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    caplog.set_level(logging.WARNING)
    router = RouterThread(RouterConfig(), host=address)
    try:
        def from_outside(method: bytes, path: bytes, body: bytes) -> int:
            head = [method + b" " + path + b" HTTP/1.1", b"Host: x", b"Connection: close",
                    b"Content-Length: %d" % len(body)]
            with socket.create_connection((address, router.port), timeout=10) as sock:
                sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            return int(answer.split(b"\r\n", 1)[0].split()[1])

        for path in (b"/register", b"/unregister"):
            assert from_outside(b"POST", path, b'{"endpoint": "tcp://127.0.0.1:9"}') == 401
        assert router.call(lambda: router.router.num_unauthorized) == 2
        assert from_outside(b"POST", b"/lookup", b'{"token_ids": [1]}') == 200
    finally:
        router.stop()
    refused = [r.getMessage() for r in caplog.records if "only loopback" in r.getMessage()]
    assert refused and "kvstrata router" in refused[0] and address in refused[0]
