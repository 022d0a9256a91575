"""The remote tier against real `redis-server` processes on loopback (no mocks).

Two processes with different disk paths share prefixes bit-exact through the server; other
namespaces never hit; damaged values are misses and are deleted; a killed server makes
misses (stores still succeed locally, calls return within bounded time) and the tier
recovers when the server is back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError
from tests import ROOT
from tests.redis_fixtures import RedisServer, need_redis, redis_server
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.shared_tiers import last_tier
from tests.tiers.shared_tiers import prompt_tokens as _tokens
from tiers.keys import TierKind
from tiers.remote.tier import RemoteTier, redacted


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def _store(url: str, disk: Path | None = None, *, namespace: str = "remote-test", **overrides: object) -> KVCacheStore:
    kwargs: dict[str, object] = {
        "layout": LAYOUT, "block_size": BLOCK, "namespace": namespace, "cpu_bytes": 16 * LAYOUT.block_bytes(BLOCK),
        "disk_path": str(disk) if disk else None, "disk_bytes": 32 << 20, "disk_sync": False, "remote_url": url,
    }
    kwargs.update(overrides)
    return KVCacheStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def _remote(store: KVCacheStore) -> RemoteTier:
    return last_tier(store, RemoteTier)


_WRITER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv
    from tests.tiers.test_remote import _store, _tokens
    with _store(sys.argv[1], disk=__import__("pathlib").Path(sys.argv[2])) as store:
        for seed in range(5):
            t = _tokens(6, seed)
            store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush()
    print(json.dumps({"ok": True}))
    """
)


def test_two_processes_with_different_disks_share_prefixes(server: RedisServer, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _WRITER, server.url, str(tmp_path / "host-a"), str(ROOT)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    with _store(server.url, tmp_path / "host-b") as store:  # another "host": empty CPU and disk tiers
        for seed in range(5):
            t = _tokens(6, seed)
            res = store.retrieve(t)
            assert res.num_tokens == len(t) and res.blocks_per_tier == {TierKind.REMOTE: 6}
            check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
        t = _tokens(6, 0)
        local = store.retrieve(t).blocks_per_tier  # the remote hits were promoted into local tiers
        assert TierKind.REMOTE not in local and sum(local.values()) == 6
        store.check_integrity()
        keys = list(redis.Redis(port=server.port).scan_iter(match="kvstrata:*:2.*"))  # blocks, not the generation
        assert len(keys) == 30 and all(k.startswith(_remote(store).key_prefix) for k in keys)


def test_other_namespaces_and_salts_never_hit(server: RedisServer) -> None:
    t = _tokens(4, 1)
    with _store(server.url, namespace="model-a") as a, _store(server.url, namespace="model-b") as b:
        a.store(t, make_kv(t, LAYOUT, BLOCK))
        assert a.flush()
        assert b.lookup(t) == 0 and b.retrieve(t).num_tokens == 0
        b.clear()  # clears only model-b's keys
        with _store(server.url, namespace="model-a") as a2:
            assert a2.lookup(t) == len(t)
        a.clear()
        with _store(server.url, namespace="model-a") as a3:
            assert a3.lookup(t) == 0


@pytest.mark.parametrize("damage", ["flip-payload", "truncate", "append", "other-key"])
def test_damaged_values_are_misses_and_deleted(server: RedisServer, damage: str) -> None:
    t, other = _tokens(4, 2), _tokens(4, 3)
    with _store(server.url, cpu_bytes=0, disk_path=None, pool_blocks=0) as store:
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        store.store(other, make_kv(other, LAYOUT, BLOCK))
        assert store.flush()
        raw = redis.Redis(port=server.port)
        tier = _remote(store)
        key = tier.server_key(store.block_hashes(t)[2])
        value = raw.get(key)
        assert value is not None
        if damage == "flip-payload":
            bad = value[:-5] + bytes([value[-5] ^ 0x10]) + value[-4:]
        elif damage == "truncate":
            bad = value[: len(value) // 2]
        elif damage == "append":
            bad = value + b"\x00" * 16
        else:  # a sound record of another block under this key
            bad = raw.get(tier.server_key(store.block_hashes(other)[2]))
        raw.set(key, bad)
        res = store.retrieve(t)
        assert res.num_tokens == 2 * BLOCK  # stops before the damaged block
        check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert raw.get(key) is None, "a damaged value was not deleted"
        assert tier.stats().num_corrupt == 1


@pytest.mark.slow
def test_dead_server_is_a_miss_and_the_tier_recovers(tmp_path: Path) -> None:
    need_redis()
    server = RedisServer().start()
    try:
        t = _tokens(4, 4)
        with _store(server.url, tmp_path / "d", remote_timeout_s=0.3) as store:
            store.store(t, make_kv(t, LAYOUT, BLOCK))
            assert store.flush()
            server.kill()
            started = time.monotonic()
            for seed in range(10, 20):  # stores keep working locally; the remote writes are dropped
                u = _tokens(4, seed)
                store.store(u, make_kv(u, LAYOUT, BLOCK))
                res = store.retrieve(u)
                assert res.num_tokens == len(u)
                check_kv(u, res.kv, res.num_tokens, LAYOUT, BLOCK)
            store.tiers[0].clear()
            store.tiers[1].clear()  # only the dead remote could serve t now: a miss, no exception
            assert store.retrieve(t).num_tokens == 0
            store.flush()
            assert time.monotonic() - started < 15, "calls against a dead server were not bounded"
            tier = _remote(store)
            assert tier.num_errors > 0
            server.start()  # back on the same port (empty: it kept nothing)
            time.sleep(5.5)  # the breaker's cooldown
            v = _tokens(4, 30)
            deadline = time.monotonic() + 20
            # the tier reconnects by itself, finds the generation lost with the server's keys and
            # takes a fresh one (a write may still be dropped)
            while tier.match_prefix(store.block_hashes(v)) < len(v) // BLOCK:
                assert time.monotonic() < deadline, "the remote tier did not recover"
                store.tiers[0].clear()
                store.tiers[1].clear()
                store.store(v, make_kv(v, LAYOUT, BLOCK))  # local tiers emptied: put again reaches the remote
                assert store.flush()
                time.sleep(0.2)
        with _store(server.url, tmp_path / "fresh") as fresh:
            res = fresh.retrieve(v)
            assert res.blocks_per_tier == {TierKind.REMOTE: 4}
            check_kv(v, res.kv, res.num_tokens, LAYOUT, BLOCK)
    finally:
        server.stop()


def test_bad_urls_are_config_errors_and_passwords_are_redacted() -> None:
    for url in ("http://h:1", "redis//nohost", "redis://", 7):
        with pytest.raises(ConfigError):
            StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, remote_url=url)  # type: ignore[arg-type]
    assert "s3cret" not in redacted("redis://user:s3cret@host:6379/0")
    with pytest.raises(ConfigError) as info:
        StoreConfig(LAYOUT, block_size=BLOCK, remote_url="redis+clusterx://u:s3cret@h:1")
    assert "s3cret" not in str(info.value)
    assert json.dumps  # keep the import honest for the writer script's output


def test_cluster_spreads_keys_and_a_dead_master_is_partial_misses(tmp_path: Path) -> None:
    """A 3-master cluster (redis-cli --cluster create): keys land on every master; with one
    master killed, retrieves return shorter prefixes, never errors or wrong bytes."""
    from tests.redis_fixtures import redis_cluster

    with redis_cluster(3) as cluster:
        prompts = [_tokens(8, 40 + i) for i in range(12)]
        with _store(cluster.url, cpu_bytes=0, disk_path=None, pool_blocks=0, remote_timeout_s=0.5) as store:
            for t in prompts:
                store.store(t, make_kv(t, LAYOUT, BLOCK))
            assert store.flush()
            per_node = [len(list(redis.Redis(port=s.port).scan_iter(match="kvstrata:*:2.*"))) for s in cluster.servers]
            assert sum(per_node) == 12 * 8 and all(n > 0 for n in per_node), per_node
            for t in prompts:
                res = store.retrieve(t)
                assert res.num_tokens == len(t) and res.blocks_per_tier == {TierKind.REMOTE: 8}
                check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
            cluster.servers[1].kill()
            started = time.monotonic()
            served = 0
            for t in prompts:
                res = store.retrieve(t)  # a miss where the dead master held a block: no exception
                check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
                served += res.num_tokens
            assert served < 12 * 8 * BLOCK
            assert time.monotonic() - started < 30


_CONCURRENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
    from tests.tiers.test_remote import _store, _tokens
    rng = np.random.default_rng(int(sys.argv[2]))
    checked = 0
    with _store(sys.argv[1], cpu_bytes=0, disk_path=None, pool_blocks=0) as store:
        for _ in range(60):
            t = _tokens(int(rng.integers(1, 6)), int(rng.integers(0, 8)))  # 8 shared prompts
            if rng.random() < 0.5:
                store.store(t, make_kv(t, LAYOUT, BLOCK))
            else:
                res = store.retrieve(t)
                checked += check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
        store.flush()
    print(checked)
    """
)


def test_processes_writing_and_reading_the_same_keys(server: RedisServer) -> None:
    """Four processes store and retrieve the same prompts at once: every block any of them
    gets back is bit-exact (the same key always carries the same bytes)."""
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, server.url, str(seed), str(ROOT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in range(4)]
    checked = 0
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        checked += int(out.strip().splitlines()[-1])
    assert checked > 0


def test_demo_remote_two_hosts_share_a_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli import main as kvstrata

    with redis_server() as server:
        rc = kvstrata.main(["demo-remote", "--url", server.url, "--tokens", "512", "--disk-path", str(tmp_path / "d")])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("host ")]
    assert "remote 512" in rows[1] and [r.split()[-1] for r in rows] == ["yes"] * 3, out


def test_fleet_replay_hits_more_with_the_remote_tier(server: RedisServer) -> None:
    """Four hosts round-robin over a synthetic trace of shared prefixes: with the remote tier
    every host hits what any host stored (the infinite-cache ceiling here); without it, only
    its own."""
    from bench.fleet import run_fleet

    requests = [[r % 5, 100 + r % 5, 1000 + r] for r in range(40)]  # 5 shared 2-block prefixes
    result = run_fleet(requests, 4, pool_blocks=64, cpu_blocks=0, remote_url=server.url)
    local, shared = result["local"], result["shared"]
    assert shared["hit_ratio"] > local["hit_ratio"]
    assert shared["hit_ratio"] == pytest.approx(result["infinite_hit_ratio"])
    assert shared["hits_remote"] > 0


def test_ttl_and_a_full_noeviction_server(caplog: pytest.LogCaptureFixture) -> None:
    """Records carry the TTL asked for; a server that is full under `noeviction` answers OOM:
    writes are skipped and counted, reads miss, nothing raises, and connecting warns."""
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as server:
        with caplog.at_level("WARNING"):
            store = _store(server.url, cpu_bytes=0, disk_path=None, pool_blocks=0, remote_ttl_s=3600)
        assert any("noeviction" in r.message for r in caplog.records)
        try:
            t = _tokens(2, 5)
            store.store(t, make_kv(t, LAYOUT, BLOCK))
            assert store.flush()
            key = _remote(store).server_key(store.block_hashes(t)[0])
            assert 0 < redis.Redis(port=server.port).ttl(key) <= 3600
            for seed in range(200):  # ~3 MiB more than the server takes
                u = _tokens(4, 100 + seed)
                store.store(u, make_kv(u, LAYOUT, BLOCK))
            assert store.flush()
            tier = _remote(store)
            assert tier.num_write_drops > 0 and tier.num_errors > 0
            res = store.retrieve(_tokens(4, 299))  # not on the server: a miss
            assert res.num_tokens == 0
        finally:
            store.close()


def test_password_from_url_or_environment_never_logged(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    t = _tokens(2, 6)
    with redis_server("--requirepass", "s3cret") as server:
        with caplog.at_level("WARNING"), _store(server.url.replace("//", "//:s3cret@"), cpu_bytes=0,
                                                 disk_path=None, pool_blocks=0) as store:
            store.store(t, make_kv(t, LAYOUT, BLOCK))
            assert store.flush() and _remote(store).num_errors == 0
        monkeypatch.setenv("KVSTRATA_REMOTE_PASSWORD", "s3cret")
        with _store(server.url, cpu_bytes=0, disk_path=None, pool_blocks=0) as store:
            assert store.lookup(t) == len(t)
        monkeypatch.setenv("KVSTRATA_REMOTE_PASSWORD", "wrong")
        with caplog.at_level("WARNING"), _store(server.url, cpu_bytes=0, disk_path=None, pool_blocks=0) as store:
            assert store.lookup(t) == 0  # refused by the server: a miss, logged without the password
        assert "s3cret" not in caplog.text and "wrong" not in caplog.text
        # the tier itself reads no environment: the store hands it the library's password
        monkeypatch.setenv("KVSTRATA_REMOTE_PASSWORD", "s3cret")
        for password, answers in ((None, False), ("s3cret", True)):
            given = {} if password is None else {"password": password}
            tier = RemoteTier(server.url, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=b"password-test", **given)
            try:
                tier.match_prefix([b"\x00" * 16])
                assert (tier.num_errors == 0) is answers, password
            finally:
                tier.close()
