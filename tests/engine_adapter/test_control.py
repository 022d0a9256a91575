"""The control listener (`engine_adapter/control.py`) over real HTTP on a real store with a
real disk tier: `POST /prefetch` warms the CPU tier; every bad request is one counted refusal
naming its field, and changes nothing."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_adapter.control import MAX_BODY_BYTES, ControlListener
from kvstore import ConfigError, ExtraKeys, KVCacheStore, StoreConfig
from tests.conftest import BLOCK, LAYOUT, make_kv
from tests.http_json import post_json
from tiers.keys import TierKind

TOKEN = "a-control-token-of-some-length"
TOKENS = list(range(7, 7 + 5 * BLOCK))


def post(url: str, body: object, token: str | None = None, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    return post_json(f"{url}/prefetch", body, token=token, raw=raw)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVCacheStore]:
    config = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=16 * LAYOUT.block_bytes(BLOCK),
                         disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, disk_sync=False)
    with KVCacheStore(config) as first:
        first.store(TOKENS, make_kv(len(TOKENS), seed=1))
        first.store(TOKENS, make_kv(len(TOKENS), seed=2), extra_keys=ExtraKeys(cache_salt="tenant-b"))
    with KVCacheStore(config) as reopened:  # everything on disk, the CPU tier empty
        yield reopened


def test_post_prefetch_warms_the_cpu_tier_under_the_requests_salt(store: KVCacheStore) -> None:
    with ControlListener(store) as listener:
        status, body = post(listener.url, {"prompt_token_ids": TOKENS, "cache_salt": "tenant-b", "wait_s": 10})
        assert status == 200, body
        assert (body["status"], body["num_promoted"], body["num_in_memory"]) == ("done", 5, 5)
        salted = ExtraKeys(cache_salt="tenant-b")
        got = store.retrieve(TOKENS, extra_keys=salted)
        assert got.blocks_per_tier == {TierKind.CPU: 5}
        want = make_kv(len(TOKENS), seed=2).view(torch.int16)
        assert got.kv is not None and torch.equal(got.kv.view(torch.int16), want)
        assert store.locate(TOKENS) == [TierKind.DISK] * 5  # the unsalted prefix was not touched
        status, body = post(listener.url, {"prompt_token_ids": TOKENS})  # no wait: queued
        assert status == 202 and body["status"] == "queued" and body["num_tokens"] == len(TOKENS)
        assert listener.counters["accepted"] == 2 and listener.counters["bad_requests"] == 0


def test_bad_requests_are_counted_refusals_naming_the_field(store: KVCacheStore,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with ControlListener(store, token=TOKEN) as listener:
        assert post(listener.url, {"prompt_token_ids": TOKENS})[0] == 401
        assert post(listener.url, {"prompt_token_ids": TOKENS}, token="x" * 20)[0] == 401
        refused = [r.getMessage() for r in caplog.records if "bearer token" in r.getMessage()]
        assert refused and "from 127.0.0.1" in refused[0] and "x" * 20 not in refused[0]  # never silent
        cases: list[tuple[object, str]] = [
            ({"prompt_token_ids": TOKENS, "lora_name": "adapter"}, "lora_name"),
            ({"prompt_token_ids": TOKENS, "multi_modal_data": {}}, "multi_modal_data"),
            ({"prompt_token_ids": [1.5, 2]}, "prompt_token_ids"),
            ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
            ({"prompt_token_ids": []}, "prompt_token_ids"),
            ({"prompt_token_ids": TOKENS, "cache_salt": 3}, "cache_salt"),
            ({"prompt_token_ids": TOKENS, "max_blocks": 0}, "max_blocks"),
            ({"prompt_token_ids": TOKENS, "wait_s": 1e9}, "wait_s"),
            ([1, 2, 3], "body"),
        ]
        for body, field in cases:
            status, answer = post(listener.url, body, token=TOKEN)
            assert (status, answer.get("field")) == (400, field), (body, answer)
        assert post(listener.url, None, token=TOKEN, raw=b"{not json")[1]["field"] == "body"
        status, answer = post(listener.url, None, token=TOKEN, raw=b"[" + b"1," * (MAX_BODY_BYTES // 2) + b"1]")
        assert status == 413, answer
        assert listener.counters["unauthorized"] == 2
        assert listener.counters["bad_requests"] == len(cases) + 2 and listener.counters["accepted"] == 0
        assert store.stats().num_prefetch_calls == 0 and store.locate(TOKENS) == [TierKind.DISK] * 5


def test_requests_past_the_rate_limit_are_counted_429s(store: KVCacheStore) -> None:
    with ControlListener(store, rate_per_s=0.01, burst=2) as listener:
        statuses = [post(listener.url, {"prompt_token_ids": TOKENS})[0] for _ in range(4)]
        assert statuses == [202, 202, 429, 429] and listener.counters["rate_limited"] == 2


def test_a_listener_other_hosts_can_reach_needs_a_token(store: KVCacheStore) -> None:
    with pytest.raises(ConfigError, match="reachable from other hosts"):
        ControlListener(store, "0.0.0.0")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        ControlListener(store, token="short")
    with ControlListener(store) as first, pytest.raises(ConfigError, match="cannot listen"):
        ControlListener(store, port=first.port).start()


def _raw(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n").split(b"\r\n")[0].split()[1])


def test_bytes_no_client_should_send_are_counted_4xx_without_a_traceback(
        store: KVCacheStore, caplog: pytest.LogCaptureFixture) -> None:
    """A non-UTF-8 Expect header and a body whose Content-Encoding does not decode were 500s
    with a logged traceback; a request line aiohttp's parser refuses logged one too."""
    caplog.set_level(logging.WARNING)
    body = b'{"prompt_token_ids": [1, 2, 3]}'
    head = b"POST /prefetch HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n" % len(body)
    with ControlListener(store) as listener:
        assert _raw(listener.port, head + b"Expect: \xff\xfe\r\n\r\n" + body) == 417
        assert _raw(listener.port, head + b"Content-Encoding: gzip\r\n\r\n" + body) == 400
        assert _raw(listener.port, b"POST /pre\xfffetch HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == 400
        assert _raw(listener.port, head + b"Expect: 100-continue\r\n\r\n" + body) == 202
        assert listener.counters["bad_requests"] == 3 and listener.counters["accepted"] == 1
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
