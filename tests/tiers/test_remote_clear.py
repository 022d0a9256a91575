"""`clear()` on the remote tier, against real redis-server processes: a clear moves the
namespace to a new generation, so no store (a fresh one, or a live one that read the old
blocks) gets KV stored before it, even while old blocks are still on the server; the old
blocks are then deleted in resumable SCAN rounds (one pass over a server of 1.5 M other keys,
never a restart from cursor 0), and a clear that cannot finish says so in its result, a
counter and a warning.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis

from kvstore import ClearResult, KVCacheStore
from tests.redis_fixtures import RedisServer, redis_server
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.test_remote import _remote, _store, _tokens

OTHER_KEYS = 1_500_000
PROMPTS = 30


def _remote_only(url: str) -> KVCacheStore:
    return _store(url, cpu_bytes=0, disk_path=None, pool_blocks=0)


def _prompts() -> list[np.ndarray]:
    return [_tokens(4, 200 + i) for i in range(PROMPTS)]


def _fill(store: KVCacheStore) -> None:
    for t in _prompts():
        assert store.store(t, make_kv(t, LAYOUT, BLOCK)) == len(t)
    assert store.flush()


def _blocks_on(raw: redis.Redis) -> list[bytes]:
    return list(raw.scan_iter(match="kvstrata:*:2.*", count=10_000))


def _pre_clear_hits(url: str) -> int:
    """Prompts a fresh store still finds any block of."""
    with _remote_only(url) as fresh:
        return sum(fresh.lookup(t) > 0 for t in _prompts())


@pytest.fixture(scope="module")
def crowded() -> Iterator[RedisServer]:
    """A server holding 1.5 M keys kvstrata did not write (`DEBUG POPULATE`)."""
    with redis_server("--enable-debug-command", "local", "--maxmemory", "0") as server:
        redis.Redis(port=server.port).execute_command("DEBUG", "POPULATE", OTHER_KEYS, "other")
        yield server


@pytest.mark.slow
def test_a_clear_among_a_million_other_keys_leaves_no_pre_clear_kv(crowded: RedisServer) -> None:
    """The issue's case: a fresh store after the clear gets no pre-clear KV, and the clear walks
    the keyspace once (about 1.5 M / 10,000 SCAN rounds), deleting every block and no other key."""
    raw = redis.Redis(port=crowded.port)
    with _remote_only(crowded.url) as store:
        _fill(store)
        assert _pre_clear_hits(crowded.url) == PROMPTS
        scans = raw.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
        result = store.clear()
        assert _pre_clear_hits(crowded.url) == 0, "a fresh store got KV stored before the clear"
        assert isinstance(result, ClearResult)
        scans = raw.info("commandstats")["cmdstat_scan"]["calls"] - scans
        assert scans < 1000, f"{scans} SCAN rounds for one pass over {OTHER_KEYS} keys: the cursor restarted"
        tier = _remote(store)
        if result.complete:  # the expected outcome here (the default budget is 30 s)
            assert result.num_remote_deleted == PROMPTS * 4 and _blocks_on(raw) == []
            assert tier.num_clears_incomplete == 0
        else:
            assert tier.num_clears_incomplete == 1
        assert raw.dbsize() == OTHER_KEYS + 1  # the others, and the namespace's generation
        t = _prompts()[0]  # the namespace works on under its new generation
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush() and _pre_clear_hits(crowded.url) == 1


@pytest.mark.slow
def test_a_clear_that_runs_out_of_time_says_so_and_still_hides_the_old_blocks(
        crowded: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    raw = redis.Redis(port=crowded.port)
    with _remote_only(crowded.url) as store:
        _fill(store)
        tier = _remote(store)
        tier.clear_budget_s = 0.0  # one SCAN round: 10,000 of about 2 M slots
        with caplog.at_level("WARNING"):
            result = store.clear()
        assert result.complete is False and result.num_remote_deleted < PROMPTS * 4
        assert tier.num_clears_incomplete == 1
        assert any("clear() deleted" in r.message and "not all" in r.message for r in caplog.records)
        assert len(_blocks_on(raw)) > 0  # old blocks left on the server ...
        assert _pre_clear_hits(crowded.url) == 0  # ... that no reader finds
        tier.clear_budget_s = 30.0
        again = store.clear()  # the next clear removes them
        assert again.complete and _blocks_on(raw) == [] and raw.dbsize() == OTHER_KEYS + 1


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def test_a_live_store_stops_reading_blocks_another_store_cleared(server: RedisServer) -> None:
    """Store B read the blocks; store A clears. Even with every old block put back on the
    server (a sweep that never reached them), B and a fresh store find none of them."""
    raw = redis.Redis(port=server.port)
    with _remote_only(server.url) as a, _remote_only(server.url) as b:
        _fill(a)
        t = _prompts()[0]
        res = b.retrieve(t)
        assert res.num_tokens == len(t)
        check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
        old = {k: raw.get(k) for k in _blocks_on(raw)}
        result = a.clear()
        assert result.complete and result.num_remote_deleted == PROMPTS * 4 and _blocks_on(raw) == []
        raw.mset(old)  # as if the sweep had not reached them yet
        assert b.retrieve(t).num_tokens == 0 and b.lookup(t) == 0
        assert sum(b.lookup(u) for u in _prompts()) == 0
        assert _pre_clear_hits(server.url) == 0


def test_a_clear_deletes_only_kvstrata_keys_of_its_namespace(server: RedisServer) -> None:
    """Keys under the namespace's prefix that kvstrata did not write, other namespaces and
    blocks of the first key layout: only the latter (this namespace's) go."""
    raw = redis.Redis(port=server.port)
    with _remote_only(server.url) as store, _store(server.url, cpu_bytes=0, disk_path=None, pool_blocks=0,
                                                   namespace="another") as other:
        _fill(store)
        t = _prompts()[1]
        other.store(t, make_kv(t, LAYOUT, BLOCK))
        assert other.flush()
        prefix = _remote(store).key_prefix
        foreign, layout1 = prefix + b"not-a-block-hash", prefix + b"ab" * 16
        raw.set(foreign, b"x")
        raw.set(layout1, b"an old record")
        result = store.clear()
        assert result.complete and result.num_remote_deleted == PROMPTS * 4 + 1
        assert raw.get(foreign) == b"x" and raw.get(layout1) is None
        assert other.lookup(t) == len(t)
        everything = other.clear(all_namespaces=True)
        assert everything.complete and raw.get(foreign) == b"x"
        assert [k for k in raw.scan_iter() if k != foreign] == [_remote(other).key_prefix + b"gen2"]


def test_a_clear_walks_every_master_of_a_cluster() -> None:
    from tests.redis_fixtures import redis_cluster

    with redis_cluster(3) as cluster, _remote_only(cluster.url) as store:
        _fill(store)
        nodes = [redis.Redis(port=s.port) for s in cluster.servers]
        assert all(_blocks_on(n) for n in nodes)
        result = store.clear()
        assert result.complete and result.num_remote_deleted == PROMPTS * 4
        assert not any(_blocks_on(n) for n in nodes)
        assert _pre_clear_hits(cluster.url) == 0
        t = _prompts()[0]
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush() and _pre_clear_hits(cluster.url) == 1
