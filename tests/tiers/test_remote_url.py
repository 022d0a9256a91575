"""The remote tier's URL: every credential form redis-py reads is redacted wherever a URL is
shown (messages, warnings, the tier's identity, KV events, the router's `/instances`), the
identity still tells servers and databases apart, and a URL kvstrata cannot use is one
`ConfigError` that names the problem without the secret.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from cli.ports import free_port_pair
from cli.redis_servers import redis_server
from kvstore import StoreConfig
from kvstore.errors import ConfigError
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.test_remote import _remote, _store, _tokens
from tiers.remote.tier import check_url, redacted
from tiers.remote.url import identity, parse

SECRET = "s3cretXY"

# Every place redis-py reads a credential from, for each scheme.
CREDENTIAL_URLS = [
    f"redis://:{SECRET}@cache:6379/0",
    f"redis://user:{SECRET}@cache:6379",
    f"redis://{SECRET}@cache",
    f"redis://cache:6379/0?password={SECRET}",
    f"redis://cache?username=user&password={SECRET}",
    f"rediss://cache:6380?ssl_password={SECRET}&password={SECRET}",
    f"unix:///run/redis.sock?password={SECRET}",
    f"unix:///run/redis.sock?db=2&password={SECRET}",
    f"unix://:{SECRET}@/run/redis.sock",
    f"redis+cluster://user:{SECRET}@a:7000,b:7001",
    f"redis+cluster://a:7000,b:7001?password={SECRET}",
    f"rediss+cluster://a:7000?password={SECRET}",
    f"redis://:{SECRET.replace('X', '%2F')}@cache",  # percent-encoded
    f"redis://cache#{SECRET}",
]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_every_credential_form_is_redacted_and_left_out_of_the_identity(url: str) -> None:
    check_url(url)
    assert SECRET not in redacted(url) and SECRET.replace("X", "%2F") not in redacted(url)
    assert "***" in redacted(url) or "#" in url
    ident = identity(parse(url))
    assert SECRET not in ident and "***" not in ident and "?password" not in ident


def test_the_identity_tells_servers_and_databases_apart_and_ignores_credentials() -> None:
    same = [f"redis://:{SECRET}@Cache:6379/0", "redis://cache", "redis://cache:6379/0", "redis://cache/?db=0",
            f"redis://u:{SECRET}@cache:6379?password=other"]
    assert len({identity(parse(u)) for u in same}) == 1
    different = ["redis://cache/0", "redis://cache/1", "redis://cache?db=2", "redis://cache:6380", "redis://other",
                 "rediss://cache", "unix:///run/a.sock", "unix:///run/a.sock?db=1", "unix:///run/b.sock",
                 "redis+cluster://a:1,b:2"]
    assert len({identity(parse(u)) for u in different}) == len(different)
    assert identity(parse("redis+cluster://b:2,a:1")) == identity(parse("redis+cluster://a:1,b:2"))


@pytest.mark.parametrize(("url", "names"), [
    (f"redis://:{SECRET}@cache:99999", "port"),
    (f"redis://:{SECRET}@cache:abc", "port"),
    (f"redis://cache?password={SECRET}&decode_responses=true", "decode_responses"),
    (f"redis://cache?password={SECRET}&socket_timeout=100", "remote_timeout_s"),
    (f"redis://cache?password={SECRET}&db=x", "db"),
    (f"redis://cache/notadb?password={SECRET}", "database number"),
    (f"redis://a:1,b:2?password={SECRET}", "redis+cluster"),
    (f"redis+cluster://a:1/3?password={SECRET}", "database 0"),
    (f"redis://cache?ssl_password={SECRET}", "rediss"),
    (f"redis://:pa/{SECRET}@cache", "percent-encode"),
    (f"unix://?password={SECRET}", "socket path"),
    (f"redis://cache?protocol=4&password={SECRET}", "protocol"),
    (f"http://:{SECRET}@cache", "scheme"),
])
def test_a_url_kvstrata_cannot_use_is_one_config_error_without_the_secret(url: str, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, remote_url=url)
    assert names in str(info.value) and SECRET not in str(info.value)


def test_every_credential_form_reaches_a_server_with_a_password(caplog: pytest.LogCaptureFixture) -> None:
    """A real server with `requirepass` on TCP and a unix socket: the userinfo and the
    `password=` query reach it on either; the tier's identity and every warning (for a wrong
    password too) leave the secret out."""
    sock = Path(tempfile.mkdtemp(prefix="kvstrata-sock-")) / "redis.sock"
    with redis_server("--requirepass", SECRET, "--unixsocket", str(sock)) as server:
        t = _tokens(3, 21)
        tcp = f"127.0.0.1:{server.port}"
        urls = [f"redis://:{SECRET}@{tcp}", f"redis://{tcp}/0?password={SECRET}",
                f"redis://default:{SECRET}@{tcp}", f"unix://{sock}?password={SECRET}", f"unix://:{SECRET}@{sock}"]
        with caplog.at_level("WARNING"):
            with _store(urls[0], cpu_bytes=0, disk_path=None) as writer:
                writer.store(t, make_kv(t, LAYOUT, BLOCK))
                assert writer.flush()
            for url in urls:
                with _store(url, cpu_bytes=0, disk_path=None) as store:
                    res = store.retrieve(t)
                    assert res.num_tokens == len(t), url
                    check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
                    tier = _remote(store)
                    assert tier.num_errors == 0 and SECRET not in tier.identity
            wrong = f"unix://{sock}?password=wr0ngPassw0rd"
            with _store(wrong, cpu_bytes=0, disk_path=None) as store:
                assert store.lookup(t) == 0 and _remote(store).num_errors >= 1
        assert "wr0ngPassw0rd" not in caplog.text and SECRET not in caplog.text
        assert any("remote tier" in r.message for r in caplog.records)


def test_kv_events_and_the_routers_instances_carry_no_password() -> None:
    """Two store processes publish KV events naming their remote tier by identity; the
    router's `/instances` shows that identity: no secret, and the two forms of one server's
    URL give the same identity."""
    from tests.router.test_router import Instance, RouterProcess, wait_for

    with redis_server("--requirepass", SECRET) as server:
        tcp = f"127.0.0.1:{server.port}"
        a = Instance("a", free_port_pair(), None, 8, f"redis://{tcp}?password={SECRET}")
        b = Instance("b", free_port_pair(), None, 8, f"redis://:{SECRET}@{tcp}/0")
        router = RouterProcess([a.endpoint, b.endpoint])
        try:
            a.call("store", list(range(2 * BLOCK)))
            assert a.call("flush")
            def listed() -> bool:
                body = router.get("/instances")[1] or {}
                return len(body) == 2 and all(src["remote"] for i in body.values() for src in i["sources"])

            wait_for(listed, "both instances listed with their remote tier")
            status, body = router.get("/instances")
            assert status == 200 and SECRET not in json.dumps(body)
            remotes = {src["remote"] for inst in body.values() for src in inst["sources"]}
            assert remotes == {f"redis://{tcp}/0"}
        finally:
            router.stop()
            a.close()
            b.close()


def test_configs_do_not_show_the_url_in_their_repr() -> None:
    from engine_adapter.vllm.settings import ConnectorSettings
    from kvstore.settings import LibrarySettings

    url = f"redis://cache?password={SECRET}"
    assert SECRET not in repr(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, remote_url=url))
    assert SECRET not in repr(ConnectorSettings.from_sources({"remote_url": url}, {}))
    assert SECRET not in repr(ConnectorSettings.from_sources({"tiers": [{"type": "remote", "url": url}]}, {}))
    assert SECRET not in repr(LibrarySettings(remote_password=SECRET))
