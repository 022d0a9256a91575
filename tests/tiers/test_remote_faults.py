"""The remote tier's faults, against real servers: a real `redis-server` (full, stopped,
holding keys kvstrata did not write), a cluster that is not there, and a hostile loopback
server that drips its replies (`tests/drip_server.py`). Each fault is a counted miss or a
counted dropped write, in bounded time; a write fault never makes a read a miss.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from cli.ports import free_port
from cli.redis_servers import redis_server
from kvstore import KVCacheStore
from tests.drip_server import DripServer
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.test_remote import _remote, _store, _tokens


def _remote_only(url: str, **overrides: object) -> KVCacheStore:
    return _store(url, cpu_bytes=0, disk_path=None, pool_blocks=0, **overrides)


def _bounded(fn: Callable[[], Any], limit_s: float = 30.0) -> tuple[Any, float]:
    """(fn(), seconds) run in a thread; fails the test if it is still running after `limit_s`."""
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {limit_s} s: the call is not bounded"
    if "error" in out:
        raise out["error"]
    return out["value"], out["seconds"]


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("command", ["GET", "EXISTS"])
def test_a_reply_dripped_a_byte_at_a_time_is_a_miss_within_the_deadline(command: str) -> None:
    """Each byte comes well within `remote_timeout_s`, so only a bound on the whole call ends
    it: retrieve is a miss within a small multiple of the timeout, counted as a read fault,
    and the half-read connection is closed, not reused. (EXISTS's reply is 4 bytes: dripped
    every 0.2 s, a single one takes longer than the timeout; replies that do arrive in time
    count, so a faster drip would answer a lookup a block per call.)"""
    timeout = 0.5
    # a value a record's length could be (a longer one is refused unread: test_remote_hostile.py)
    with DripServer({command}, interval_s=0.05 if command == "GET" else 0.2, reply_bytes=4096) as server:
        store = _remote_only(server.url, remote_timeout_s=timeout)
        try:
            t = _tokens(3, 7)
            result, seconds = _bounded(lambda: store.retrieve(t))
            assert result.num_tokens == 0
            assert seconds < 6 * timeout, seconds
            tier = _remote(store)
            assert tier.reads.num_errors == 1 and tier.writes.num_errors == 0
            _wait(lambda: server.num_closed >= 1, "the client closed the half-read connection")
            opened = server.num_opened
            assert _bounded(lambda: store.lookup(t))[0] == (0 if command == "EXISTS" else len(t))
            assert server.num_opened == opened + 1, "the next call did not open a fresh connection"
        finally:
            _bounded(store.close, 20.0)


def test_a_dripped_write_reply_keeps_flush_and_close_bounded() -> None:
    """The writer's batch is bounded as a whole too: flush returns well before its own 30 s
    limit, the blocks are counted as dropped, and close returns."""
    timeout = 0.5
    with DripServer({"SET"}, interval_s=0.2) as server:  # "+OK\r\n" takes 1 s, each byte 0.2 s
        store = _remote_only(server.url, remote_timeout_s=timeout)
        t = _tokens(4, 8)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        flushed, seconds = _bounded(store.flush, 60.0)
        assert flushed and seconds < 6 * timeout, (flushed, seconds)
        tier = _remote(store)
        assert tier.num_write_drops == 4 and tier.writes.num_errors == 1 and tier.reads.num_errors == 0
        _bounded(store.close, 20.0)


def test_write_faults_on_a_full_noeviction_server_never_make_reads_miss() -> None:
    """A full `noeviction` server refuses every write with OOM, which opens the writes'
    breaker; reads of blocks that are on the server must all still hit, bit-exact."""
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as server:
        store = _remote_only(server.url)
        try:
            shared = _tokens(4, 9)
            store.store(shared, make_kv(shared, LAYOUT, BLOCK))
            assert store.flush() and store.lookup(shared) == len(shared)
            tier = _remote(store)
            seed = 1000
            while tier.num_errors < 3:  # fill the server until its writes fail repeatedly
                seed += 1
                assert seed < 2000, "the server never filled"
                u = _tokens(4, seed)
                store.store(u, make_kv(u, LAYOUT, BLOCK))
                store.flush()
            hits = 0
            for i in range(30):  # writes keep failing (or are dropped while their breaker is open)
                u = _tokens(4, 5000 + i)
                store.store(u, make_kv(u, LAYOUT, BLOCK))
                res = store.retrieve(shared)
                check_kv(shared, res.kv, res.num_tokens, LAYOUT, BLOCK)
                hits += res.num_tokens == len(shared)
            assert hits == 30
            assert tier.reads.num_errors == 0 and tier.num_write_drops > 0
        finally:
            store.close()


def test_keys_in_the_namespace_that_kvstrata_did_not_write_are_skipped() -> None:
    with redis_server() as server, _remote_only(server.url) as store:
        t = _tokens(3, 10)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush()
        tier = _remote(store)
        raw = redis.Redis(port=server.port)
        raw.set(tier.key_prefix + b"not-a-block-hash", b"x")
        held = set(tier.held_hashes())
        assert held == set(store.block_hashes(t))
        assert tier.num_foreign_keys == 1
        assert raw.get(tier.key_prefix + b"not-a-block-hash") == b"x"  # never deleted: not kvstrata's


def test_a_cluster_that_is_not_there_is_a_miss_not_an_exception() -> None:
    """The cluster client contacts its nodes when it is made: with none up, the store still
    opens; stores and lookups are counted faults and misses, in bounded time."""
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    started = time.monotonic()
    with _remote_only(url, remote_timeout_s=0.3) as store:
        t = _tokens(2, 11)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush()
        assert store.lookup(t) == 0 and store.retrieve(t).num_tokens == 0
        assert _remote(store).num_errors >= 1
    assert time.monotonic() - started < 20


def test_a_stopped_server_keeps_store_retrieve_and_close_bounded() -> None:
    """A server that stops answering (SIGSTOP) mid-run: every call returns in bounded time;
    what could not be sent is counted as dropped."""
    with redis_server() as server:
        assert server.proc is not None
        store = _store(server.url, disk_path=None, remote_timeout_s=0.3)
        t = _tokens(4, 12)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for seed in range(20, 30):
                u = _tokens(4, seed)
                store.store(u, make_kv(u, LAYOUT, BLOCK))
            store.tiers[0].clear()  # only the stopped server could serve t now
            assert _bounded(lambda: store.retrieve(t))[0].num_tokens == 0
            _bounded(store.close, 30.0)
            assert time.monotonic() - started < 30
            tier = _remote(store)
            assert tier.num_write_drops > 0 and tier.num_errors >= 2
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
