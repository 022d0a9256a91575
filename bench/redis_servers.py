"""Real `redis-server` processes on loopback, for `kvstrata bench remote` and the tests.

Where no `redis-server` (or `valkey-server`) binary is installed, a test is skipped, except
under `KVSTRATA_REQUIRE_REDIS=1` (CI), where a missing server is a failure.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench.ports import free_port
from kvstore.settings import Settings


def redis_binary() -> str:
    path = shutil.which("redis-server") or shutil.which("valkey-server")
    if path is None:
        if Settings.from_sources().require_redis:
            raise AssertionError("KVSTRATA_REQUIRE_REDIS=1 but no redis-server/valkey-server is installed")
        pytest.skip("no redis-server or valkey-server installed")
    return path


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # a server with a password answers too
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `kill()` and `start()` again on the same port."""

    def __init__(self, port: int | None = None, *extra: str) -> None:  # extra: redis-server options
        self.binary = redis_binary()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvstrata-redis-")
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _ping(self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    server = RedisServer(None, *extra).start()
    try:
        yield server
    finally:
        server.stop()


class RedisCluster:
    """A cluster of `num_masters` redis-server processes (no replicas) on loopback."""

    def __init__(self, num_masters: int = 3) -> None:
        self.servers = [RedisServer(None, "--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                                    "--cluster-config-file", f"nodes-{i}.conf") for i in range(num_masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self) -> RedisCluster:
        for s in self.servers:
            s.start()
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            raise RuntimeError("redis-cli is needed to create a cluster")
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while True:  # wait until every node reports the cluster up
            states = [subprocess.run([cli, "-p", str(s.port), "cluster", "info"], capture_output=True, text=True,
                                     timeout=10).stdout for s in self.servers]
            if all("cluster_state:ok" in st for st in states):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not come up: {states}")
            time.sleep(0.2)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@contextmanager
def redis_cluster(num_masters: int = 3) -> Iterator[RedisCluster]:
    cluster = RedisCluster(num_masters)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@contextmanager
def server_url(url: str | None) -> Iterator[str]:
    """`url` if given, else the URL of a loopback redis-server started for the block."""
    if url is not None:
        yield url
        return
    with redis_server() as server:
        yield server.url
