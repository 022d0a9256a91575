"""Calls to the remote server with a bound on their total time, and the health of each kind.

redis-py bounds each socket operation by `socket_timeout`, not a call: a server that drips
its reply one byte at a time keeps a call running for ever. Here every connection's socket
consults the calling thread's deadline (`deadline()`): each send and receive may take the
time left, and no more (a connect: at most `socket_connect_timeout`), and once it is gone the
operation fails at once. Within a deadline a pause longer than `socket_timeout` is no fault
by itself: a large read may wait on a busy server as long as the whole call ends in time.
redis-py then raises `TimeoutError` and drops that connection, so none is reused in a
half-read state. A deadline may also bound the bytes its calls receive (`max_reply_bytes`):
redis-py reads whatever length a reply claims, so a server that answers INFO with
`$1073741824` and keeps sending would fill memory until the deadline; past the bound a
receive raises `ReplyTooLong` (a `ConnectionError`: redis-py drops the connection). A thread
working for another's call (a lane of a split call) runs under that call's deadline
(`deadline_at(current_deadline(), ...)`) with its own share of the bound on bytes.

`Health` (`tiers/shared/health.py`) keeps one kind of call's faults (reads apart from writes: a
full server refusing writes never makes a read a miss), its circuit breaker and its warning.
`Server` makes a tier's calls: each within its deadline and its bound on replies, each
fault counted in its kind's `Health`, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from tiers.remote.lanes import Lanes
from tiers.remote.resp import SMALL_REPLY, ReplyTooLong
from tiers.remote.stream import Op, Streams
from tiers.remote.url import UrlParts, parse, redacted, scrub
from tiers.shared.forks import renew_in_child
from tiers.shared.health import Health

logger = logging.getLogger("tiers.remote.tier")

REPLY_SLACK = 1 << 20  # what a call may receive beyond its replies (a handshake, a cluster's slot map)
CONNECTIONS_PER_NODE = 4  # by default
_INFO_BYTES = 1 << 20  # INFO memory of every node
SPLIT_FROM = 4 << 20  # a call moving fewer bytes runs on one connection per node (lanes cost a thread hop)
_local = threading.local()
_ORPHANS: list[Any] = []  # a forked child's copies of its parent's clients: never used nor closed


def deadline(seconds: float, max_reply_bytes: int) -> contextlib.AbstractContextManager[None]:
    """Bound every socket operation of this thread's redis calls in the block to end within
    `seconds` from now, together, and to receive at most `max_reply_bytes`, together."""
    return deadline_at(time.monotonic() + seconds, max_reply_bytes)


@contextlib.contextmanager
def deadline_at(end: float | None, max_reply_bytes: int) -> Iterator[None]:
    """`deadline` ending at the `time.monotonic()` value `end` (None: no bound on time): how
    a thread working for another's call runs under that call's deadline."""
    previous = getattr(_local, "deadline", None), getattr(_local, "budget", None)
    _local.deadline = end
    _local.budget = [max_reply_bytes, max_reply_bytes]  # left, bound
    try:
        yield
    finally:
        _local.deadline, _local.budget = previous


def current_deadline() -> float | None:
    """This thread's deadline (a `time.monotonic()` value; None: none)."""
    end: float | None = getattr(_local, "deadline", None)
    return end


def _charge(nbytes: int) -> None:
    """Count `nbytes` received against this thread's bound; `ReplyTooLong` once past it."""
    budget: list[int] | None = getattr(_local, "budget", None)
    if budget is not None:
        budget[0] -= nbytes
        if budget[0] < 0:
            raise ReplyTooLong("replies of one call", budget[1] - budget[0], budget[1])


def _time_left() -> float | None:
    """Seconds left before this thread's deadline (None: no deadline); `TimeoutError` (that is
    `socket.timeout`, which redis-py turns into its own `TimeoutError`) if none are left."""
    end: float | None = getattr(_local, "deadline", None)
    if end is None:
        return None
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("kvstrata: the call's deadline passed")  # socket.timeout
    return left


def _bounded(timeout: float | None, left: float | None) -> float | None:
    """`timeout` cut to `left` (None: blocking; 0: a non-blocking poll, left as is)."""
    if left is None or timeout == 0:
        return timeout
    return left if timeout is None else min(timeout, left)


class _DeadlineSocket:
    """A connected socket whose blocking operations end by the calling thread's deadline."""

    def __init__(self, sock: Any, timeout: float | None) -> None:
        self._sock = sock
        self._timeout = timeout  # what redis-py asked for
        self._armed = timeout  # what the socket has now

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = self._armed = timeout
        self._sock.settimeout(timeout)

    def setblocking(self, flag: bool) -> None:
        self.settimeout(None if flag else 0.0)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        left = _time_left()
        bound = self._timeout if left is None or self._timeout == 0 else left  # 0: redis-py polls
        if bound != self._armed:  # a system call: skipped while the deadline is further off
            self._sock.settimeout(bound)
            self._armed = bound

    def recv(self, size: int, *flags: int) -> bytes:
        self._arm()
        data: bytes = self._sock.recv(size, *flags)
        _charge(len(data))
        return data

    def recv_into(self, buffer: Any, *args: int) -> int:
        self._arm()
        n: int = self._sock.recv_into(buffer, *args)
        _charge(n)
        return n

    def recvmsg_into(self, buffers: Any, *args: int) -> tuple[int, list[Any], int, Any]:
        self._arm()
        got: tuple[int, list[Any], int, Any] = self._sock.recvmsg_into(buffers, *args)
        _charge(got[0])
        return got

    def sendall(self, data: Any, *flags: int) -> None:
        self._arm()  # since Python 3.5 a timeout bounds the whole sendall
        self._sock.sendall(data, *flags)

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        self._arm()
        return self._sock.sendmsg(buffers, *args)  # type: ignore[no-any-return]

    @property
    def gathers(self) -> bool:
        """Whether `sendmsg` and `recvmsg_into` work (not on TLS)."""
        return not isinstance(self._sock, ssl.SSLSocket)

    def __getattr__(self, name: str) -> Any:  # fileno, shutdown, close, getsockname, pending, ...
        return getattr(self._sock, name)


class _DeadlineMixin:
    """Connects within the deadline and hands redis-py a `_DeadlineSocket`."""

    socket_timeout: float | None
    socket_connect_timeout: float | None

    def _connect(self) -> Any:
        left = _time_left()
        saved = self.socket_connect_timeout, self.socket_timeout
        if left is not None:
            self.socket_connect_timeout = _bounded(saved[0], left)
            self.socket_timeout = _bounded(saved[1], left)  # a TLS handshake
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            self.socket_connect_timeout, self.socket_timeout = saved
        sock.settimeout(saved[1])
        return _DeadlineSocket(sock, saved[1])

    def deadline_socket(self) -> _DeadlineSocket:
        """The connected socket (connecting first), for `tiers/remote/stream.py`'s own RESP."""
        if getattr(self, "_sock", None) is None:
            self.connect()  # type: ignore[attr-defined]
        sock: _DeadlineSocket = self._sock  # type: ignore[attr-defined]
        return sock


def lane_of(key: bytes, lanes: int) -> int:
    """The lane (of `lanes`) that every command on `key` takes: the same for every call, so
    two commands on one key always share a connection and keep their order."""
    return zlib.crc32(key) % lanes


def _connection_class(scheme: str) -> type:
    from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection

    base = UnixDomainSocketConnection if scheme == "unix" else SSLConnection if scheme.startswith("rediss") \
        else Connection
    return type(f"Deadline{base.__name__}", (_DeadlineMixin, base), {})


def connect(url: str, timeout_s: float, parts: UrlParts | None = None, password: str | None = None) -> Any:
    """A redis-py client for `url` whose calls honour `deadline()`: `Redis`, or `RedisCluster`
    for a cluster URL (which contacts the cluster at once: call it within a deadline). The
    password is the URL's, else `password`. redis-py retries nothing."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    parts = parts or parse(url)
    password = parts.password or password or None
    # Blocks are large: read in 1 MiB chunks (a socket with a timeout polls before each read).
    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                              "socket_read_size": 1 << 20, "connection_class": _connection_class(parts.scheme)}
    if not parts.scheme.endswith("+cluster"):
        client = Redis.from_url(url, retry=Retry(NoBackoff(), 0), **common)
        if password and not client.connection_pool.connection_kwargs.get("password"):
            client.connection_pool.connection_kwargs["password"] = password
        return client
    from redis.connection import parse_url

    # The query's options, typed as redis-py types them for a standalone URL.
    query = urllib.parse.urlencode([(k, v) for k, v in parts.options if k not in ("password", "username", "db")])
    options = {k: v for k, v in parse_url(  # type: ignore[no-untyped-call]  # redis-py's parse_url is unannotated
        f"redis://x/?{query}").items() if k != "host"}
    (host, port), *others = parts.hosts
    # `url=` makes every node's pool take `connection_class` (the one that honours deadlines).
    return RedisCluster(url=f"redis://{host}:{port}", startup_nodes=[ClusterNode(h, p) for h, p in others],  # type: ignore[no-untyped-call]  # redis-py's ClusterNode is unannotated
                        username=parts.username, password=password, require_full_coverage=False,
                        retry=Retry(NoBackoff(), 1), **common, **options)


class Server:
    """The calls of one tier to its server (or cluster): one client, connected on first use,
    and windowed pipelines on it (`tiers/remote/stream.py`), large ones over
    `connections_per_node` lanes at once (`stream`). A round trip moving `nbytes`
    must end within `timeout_s + nbytes / min_rate_bps` and receive at most its replies'
    bound (and `REPLY_SLACK`), else it is a fault; reads and writes keep apart `Health`."""

    def __init__(self, url: str, *, timeout_s: float, min_rate_bps: float, cooldown_s: float,
                 window_bytes: int, password: str | None, connections_per_node: int = CONNECTIONS_PER_NODE) -> None:
        self.url = url
        self.connections_per_node = connections_per_node
        self._lanes = Lanes(connections_per_node - 1, "kvstrata-remote-lane")
        self.parts = parse(url)
        self._password = password  # used where the URL has none
        self._secrets = self.parts.secrets + [s for s in (password,) if s]
        self._timeout_s = timeout_s
        self._min_rate_bps = min_rate_bps
        self._window_bytes = window_bytes
        self.reads, self.writes = Health("read", cooldown_s, logger), Health("write", cooldown_s, logger)
        self._lock = threading.Lock()
        self._client: Any = None
        self._streams: Streams | None = None
        renew_in_child(self, "_lock")

    def _after_fork(self) -> None:
        """In a forked child: a client of its own, connected on first use. The parent's may be
        half set up by a thread the child lacks (its client made, its streams not yet), and a
        cluster client's slot-map locks (redis-py's, held while it rereads the map) may be held
        for ever; it is kept referenced, never closed (closing it would take those locks)."""
        if self._client is not None:
            _ORPHANS.append(self._client)
        self._client, self._streams = None, None

    def limit(self, nbytes: int) -> float:
        """The deadline of a round trip moving `nbytes`."""
        return self._timeout_s + nbytes / self._min_rate_bps

    def _connect(self) -> Any:
        with self._lock:
            if self._client is None:
                with deadline(self._timeout_s, REPLY_SLACK):
                    self._client = connect(self.url, self._timeout_s, self.parts, self._password)
                self._streams = Streams(self._client, self._window_bytes, current_deadline)
            return self._client

    def call(self, health: Health, what: str, nbytes: int, fn: Callable[[Any], Any], reply_bytes: int) -> Any:
        """`fn(client)` within the deadline for `nbytes`, receiving at most `reply_bytes` (and
        `REPLY_SLACK`); None if the server fails, the deadline passes, it sends more, or
        `health`'s breaker is open. A list of replies with a command the server refused (its
        exception in its place) is returned as is. Each fault is counted in `health`, with a
        rate-limited warning."""
        if not health.available():
            return None
        try:
            with deadline(self.limit(nbytes), reply_bytes + REPLY_SLACK):
                result = fn(self._connect())
        except Exception as exc:  # every server fault is a miss or a dropped write
            self.fault(health, what, exc)
            return None
        refused = [r for r in result if isinstance(r, Exception)] if isinstance(result, list) else []
        if refused:  # e.g. OOM from a full noeviction server
            self.fault(health, f"{what} ({len(refused)} of {len(result)} commands)", refused[0])
        else:
            health.ok()
        return result

    def caller(self, health: Health) -> Callable[[str, int, Callable[[Any], Any], int], Any]:
        """`call` with `health` bound."""
        return lambda what, nbytes, fn, reply_bytes: self.call(health, what, nbytes, fn, reply_bytes)

    def stream(self, health: Health, what: str, nbytes: int, ops: list[Op], on_reply: Callable[[int, Any], bool],
               buffer_for: Callable[[int], memoryview | None] | None = None, *, head: int = 0) -> bool:
        """Run `ops` as a windowed pipeline within the deadline for `nbytes`, passing each
        reply to `on_reply` until it returns False; False if the call failed as a whole.
        Errors (refused commands, a lost connection, a reply longer than its `Op.limit`) are
        one fault of `health` per call.

        With `head` > 0 a call moving at least `SPLIT_FROM` bytes is split into lanes by
        key (`lane_of`), each on its own connections and thread, under the call's deadline
        and its lane's share of the reply bound: every lane sends `ops[:head]` first, then its
        keys' commands in their order (so one key's commands keep theirs). `on_reply` is then
        called from several threads at once, in order within a lane, and False stops only
        the lane it came from."""
        lanes = self._split(ops, head) if head and nbytes >= SPLIT_FROM else [list(range(len(ops)))]
        replies = 2 * sum(op.limit for op in ops)  # a cluster may send a call twice
        if len(lanes) == 1:
            return self.call(health, what, nbytes, lambda _: self._streams.run(  # type: ignore[union-attr]
                ops, on_reply, buffer_for), replies) is not None
        return self.call(health, what, nbytes, lambda _: self._run_lanes(ops, lanes, on_reply, buffer_for),
                         replies + len(lanes) * REPLY_SLACK) is not None

    def _split(self, ops: list[Op], head: int) -> list[list[int]]:
        """The indices of each lane's ops: `ops[:head]`, then the ops whose key is its own."""
        lanes: list[list[int]] = [list(range(head)) for _ in range(self.connections_per_node)]
        for i in range(head, len(ops)):
            lanes[lane_of(ops[i].key, self.connections_per_node)].append(i)
        return [lane for lane in lanes if len(lane) > head]

    def _run_lanes(self, ops: list[Op], lanes: list[list[int]], on_reply: Callable[[int, Any], bool],
                   buffer_for: Callable[[int], memoryview | None] | None) -> list[Any]:
        """Every lane's outcomes (`Streams.run`), each lane run under this thread's deadline
        with its own bound on replies; a lane that raised is raised once all have ended."""
        end = current_deadline()
        streams: Streams = self._streams  # type: ignore[assignment]  # connected by `call`

        def lane(indices: list[int]) -> Callable[[], list[Any]]:
            mine = [ops[i] for i in indices]

            def run() -> list[Any]:
                with deadline_at(end, 2 * sum(op.limit for op in mine) + REPLY_SLACK):
                    return streams.run(mine, lambda k, reply: on_reply(indices[k], reply), buffer_for)
            return run

        outcomes: list[Any] = []
        for result in self._lanes.run([lane(indices) for indices in lanes]):
            if isinstance(result, Exception):
                raise result
            outcomes += result
        return outcomes

    def pipelined(self, health: Health, what: str, nbytes: int, commands: Callable[[Any], object]) -> list[Any] | None:
        """The replies to the commands `commands(pipe)` queues, in one round trip (None: a
        fault). A command the server refused has its exception in its place."""
        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            commands(pipe)
            return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

        replies: list[Any] | None = self.call(health, what, nbytes, run, nbytes)
        return replies

    def check_policy(self) -> None:
        """Warn (once, with the writes' warning) if the server evicts nothing when full; a
        fault of reads if it does not answer."""
        policy = self.call(self.reads, "CONFIG GET maxmemory-policy", SMALL_REPLY,
                           lambda c: c.config_get("maxmemory-policy"), SMALL_REPLY)
        values = list(policy.values()) if isinstance(policy, dict) else []
        flat = [v for v in values if isinstance(v, (str, bytes))] or [
            x for v in values if isinstance(v, dict) for x in v.values()]
        if any((p.decode() if isinstance(p, bytes) else p) == "noeviction" for p in flat):
            self.writes.warn(f"remote tier {redacted(self.url)} has maxmemory-policy noeviction: writes fail "
                             "once it is full; set maxmemory-policy allkeys-lru")

    def memory(self) -> tuple[int, int]:
        """The server's `used_memory` and `maxmemory` in bytes, summed over a cluster's
        nodes (0, 0: it did not tell, a fault of reads)."""
        info = self.call(self.reads, "INFO memory", _INFO_BYTES, lambda c: c.info("memory"), _INFO_BYTES)
        if isinstance(info, dict) and "used_memory" not in info:  # a cluster: per node
            info = {k: sum(int(v.get(k, 0)) for v in info.values() if isinstance(v, dict))
                    for k in ("used_memory", "maxmemory")}
        info = info if isinstance(info, dict) else {}
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def fault(self, health: Health, what: str, exc: BaseException) -> None:
        health.fault(f"remote tier {redacted(self.url)}: {what} failed "
                     f"({type(exc).__name__}: {scrub(str(exc), self._secrets)}); treated as a miss")

    def close(self) -> None:
        self._lanes.close()
        with contextlib.suppress(Exception):  # closing a dead connection
            if self._client is not None:
                self._client.close()
