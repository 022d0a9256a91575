"""Real `redis-server` processes on loopback, for the demos, the benchmarks and the tests.

Shipped with the `kvstrata` command, so it imports nothing test-only: a missing
`redis-server` (or `valkey-server`) binary, a server that does not start and a server that
cannot be reached raise `RedisServerError`, one line naming what to do (the command line
prints it and exits 2). The tests turn a missing binary into a skip (`tests/redis_fixtures.py`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

from cli.ports import free_port
from kvstore.errors import KVStoreError
from kvstore.settings import remote_password


class RedisServerError(KVStoreError, RuntimeError):
    """No redis-server to start, one that did not start, or a server that cannot be used."""


def find_redis_binary() -> str | None:
    """The path of `redis-server` (or `valkey-server`) on PATH, or None."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def redis_binary(option: str = "--url") -> str:
    """The path of `redis-server` (or `valkey-server`); `RedisServerError` if neither is
    installed, suggesting `option` (the command's server URL option) instead."""
    path = find_redis_binary()
    if path is None:
        raise RedisServerError(f"no redis-server or valkey-server on PATH to start: install one (apt-get install "
                               f"redis-server) or pass {option} redis://HOST:PORT of a running server")
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
                self.kill()
                raise RedisServerError(f"{self.binary} on port {self.port} did not start within 10 s")
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
            raise RedisServerError("redis-cli (or valkey-cli) is needed to create a cluster")
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while True:  # wait until every node reports the cluster up
            states = [subprocess.run([cli, "-p", str(s.port), "cluster", "info"], capture_output=True, text=True,
                                     timeout=10).stdout for s in self.servers]
            if all("cluster_state:ok" in st for st in states):
                return self
            if time.monotonic() > deadline:
                raise RedisServerError(f"cluster did not come up: {states}")
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


def check_server(url: str, option: str = "--url", timeout_s: float = 3.0) -> None:
    """Check that a Valkey/Redis server answers at `url` (given as `option`).

    Raises `ConfigError` for a malformed URL and `RedisServerError` for a server that cannot
    be used (refused, unknown host, timeout, password, database), each one line naming the
    URL (password hidden) and what to do. Changes nothing on the server.
    """
    import redis

    from tiers.remote.tier import check_url, connect, redacted

    check_url(url)
    shown = f"{option} {redacted(url)}"
    path = url.split("://", 1)[1].partition("?")[0].partition("/")[2] if "+cluster" not in url else ""
    if url.startswith(("redis://", "rediss://")):
        if path and not path.isdigit():
            raise RedisServerError(f"{shown}: database {path!r} is not a number (redis://HOST:PORT/0 names database 0)")
        try:
            port = urllib.parse.urlsplit(url).port
        except ValueError:
            port = 0
        if port == 0:
            raise RedisServerError(f"{shown}: the port is not a number in 1-65535")
    client = None
    try:
        client = connect(url, timeout_s, password=remote_password())
        client.ping()
    except redis.exceptions.AuthenticationError as exc:
        raise RedisServerError(f"{shown}: the server refused the password ({_first_sentence(exc)}): give it in the "
                               "URL (redis://:PASSWORD@HOST:PORT) or in KVSTRATA_REMOTE_PASSWORD") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise RedisServerError(f"{shown}: no server answers ({_first_sentence(exc)}): start one there, or leave "
                               f"out {option} to start one on loopback") from None
    except (redis.exceptions.RedisError, ValueError) as exc:  # a bad database index, port, cluster mode, ...
        raise RedisServerError(f"{shown}: the server refused it ({_first_sentence(exc)})") from None
    finally:
        if client is not None:
            client.close()


def _first_sentence(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text.split(". ", 1)[0].rstrip(".")


@contextmanager
def server_url(url: str | None, option: str = "--url") -> Iterator[str]:
    """`url` once `check_server` accepts it (given as `option`), else the URL of a loopback
    redis-server started for the block (`RedisServerError` if none can be)."""
    if url is not None:
        check_server(url, option)
        yield url
        return
    redis_binary(option)
    with redis_server() as server:
        yield server.url
