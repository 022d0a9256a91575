"""Loopback `redis-server` processes for the tests, skipped where none is installed.

`cli.redis_servers` (shipped with the `kvstrata` command) raises `RedisServerError` when no
`redis-server`/`valkey-server` binary is installed; here that becomes a skip, except under
`KVSTRATA_TEST_REQUIRE_REDIS=1` (CI), where it is a failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cli import redis_servers
from cli.redis_servers import RedisCluster, RedisServer
from tests.switches import switches

__all__ = ["RedisCluster", "RedisServer", "need_redis", "redis_cluster", "redis_server"]


def need_redis() -> str:
    """The redis-server binary's path; skips the test (fails under KVSTRATA_TEST_REQUIRE_REDIS=1) if none."""
    path = redis_servers.find_redis_binary()
    if path is None:
        if switches().require_redis:
            pytest.fail("KVSTRATA_TEST_REQUIRE_REDIS=1 but no redis-server/valkey-server is installed")
        pytest.skip("no redis-server or valkey-server installed")
    return path


@contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    """A started loopback server (`extra`: redis-server options), stopped afterwards."""
    need_redis()
    with redis_servers.redis_server(*extra) as server:
        yield server


@contextmanager
def redis_cluster(num_masters: int = 3) -> Iterator[RedisCluster]:
    """A started loopback cluster of `num_masters` servers, stopped afterwards."""
    need_redis()
    with redis_servers.redis_cluster(num_masters) as cluster:
        yield cluster
