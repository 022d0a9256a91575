"""Windowed pipelines: many commands streamed over one connection per server node.

redis-py sends a pipeline whole and reads its replies after: the server then builds every
reply before the client takes the first, and for a prompt of 2 MiB blocks that is hundreds
of MiB of output buffers allocated, faulted in, copied and pushed out of the CPU caches,
on both sides. Here a call's pass over its commands keeps, on each connection (a *node
pass*: one per node the pass touches; a call split into lanes by `Server.stream` runs one
pass per lane, each on its own thread), at most `window_bytes` of commands unanswered,
refilling when half is answered, so the data in flight stays small and warm; replies are
taken in the commands' order across node passes while every node works on its window (a
cluster's nodes work in parallel). A call that stops early (a read's first miss) sends
nothing more and reads only what is in flight.

Connections come from the client's redis-py pools (so every URL form, TLS and credentials
behave as before) and honour the calling thread's deadline (`tiers/remote/client.py`); a
connection is returned to its pool only with every reply read, otherwise it is closed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from tiers.remote.resp import (
    SMALL_REPLY,
    Buffer,
    Landed,
    Oversized,
    ReplyError,
    ReplyTooLong,
    RespReader,
    command,
    send_all,
)
from tiers.shared.forks import renew_in_child

__all__ = ["Landed", "Op", "Oversized", "ReplyError", "ReplyTooLong", "Streams", "command"]

# The reply to one command (a bulk value only during the callback that receives it), or the
# exception that ended its connection.
OnReply = Callable[[int, Any], bool]  # (command index, reply) -> go on?
BufferFor = Callable[[int], memoryview | None]
Deadline = Callable[[], float | None]  # the calling thread's deadline (`time.monotonic()`; None: none)
_REFRESH_EVERY_S = 1.0  # a cluster's slot map is reread at most this often after a fault


class Op(NamedTuple):
    """One command: the key that routes it, its packed buffers, the bytes it moves both
    ways (for the window), whether its reply is a bulk value to read into a buffer, the
    most its reply may hold on the wire (a longer claim ends the connection: `ReplyTooLong`),
    and where a longer bulk value's last bytes land (`RespReader.bulk_into`'s `tail`; a
    reply read only to be dropped never lands there)."""

    key: bytes
    buffers: list[Buffer]
    cost: int
    bulk: bool = False
    limit: int = SMALL_REPLY
    tail: Sequence[memoryview] | None = None


class _NodePass:
    """The commands of one pass that go to one node, on one connection."""

    def __init__(self, pool: Any, error: Exception | None = None) -> None:
        self.pool = pool
        self.conn: Any = None
        self.error = error
        self.todo: deque[int] = deque()
        self.sent: deque[int] = deque()
        self.outstanding = 0

    def open(self) -> None:
        try:
            self.conn = self.pool.get_connection()
            self.sock = self.conn.deadline_socket()
            self.reader = RespReader(self.sock)
        except Exception as exc:  # a dead node: this node's commands fail, the others go on
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        self.error = self.error or exc
        if self.conn is not None:
            self.conn.disconnect()

    def fill(self, ops: Sequence[Op], window_bytes: int) -> None:
        """Send the next commands until `window_bytes` are unanswered (when half or less is)."""
        if self.error is not None or not self.todo or self.outstanding > window_bytes // 2:
            return
        buffers: list[Buffer] = []
        while self.todo and self.outstanding < window_bytes:
            i = self.todo.popleft()
            buffers += ops[i].buffers
            self.sent.append(i)
            self.outstanding += ops[i].cost
        try:
            send_all(self.sock, buffers, gather=self.sock.gathers)
        except Exception as exc:
            self.fail(exc)

    def read(self, op: Op, buffer_for: BufferFor) -> Any:
        if self.error is not None:
            return self.error
        try:
            reply = self.reader.bulk_into(buffer_for, op.limit, op.tail) if op.bulk else self.reader.reply(op.limit)
        except Exception as exc:  # a timeout, a dropped connection, a protocol error
            self.fail(exc)
            return exc
        self.sent.popleft()
        self.outstanding -= op.cost
        return reply

    def finish(self, ops: Sequence[Op]) -> None:
        """Read what is still in flight (dropping it), then return the connection to its
        pool; close it instead if anything failed."""
        if self.conn is None:
            return
        while self.sent and self.error is None:
            self.read(ops[self.sent[0]], _drop)
        if self.error is None and self.reader.idle:
            self.pool.release(self.conn)
        else:
            self.conn.disconnect()
            self.pool.release(self.conn)


def _drop(size: int) -> None:
    return None


class Streams:
    """Windowed pipelines on one redis-py client (`Redis` or `RedisCluster`). Thread-safe:
    each call (and each lane of a call split by `Server.stream`) takes its own connections;
    `deadline` tells a call's thread its deadline (`tiers/remote/client.py`)."""

    def __init__(self, client: Any, window_bytes: int, deadline: Deadline) -> None:
        self._client = client
        self._window_bytes = window_bytes
        self._deadline = deadline
        self._cluster = hasattr(client, "nodes_manager")
        self._stale = False  # a cluster call saw a redirect or a dead node: reread the slot map
        self._refreshed_at = -_REFRESH_EVERY_S
        self._epoch = 0  # slot map rereads so far
        self._refreshing = threading.Lock()  # lanes of one call run at once (tiers/remote/lanes.py)
        renew_in_child(self, "_refreshing")

    def _node_passes(self, ops: Sequence[Op], start: int) -> list[_NodePass]:
        """The node pass of each command from `start` on, in order (one per connection pool)."""
        if not self._cluster:
            node = _NodePass(self._client.connection_pool)
            node.todo.extend(range(start, len(ops)))
            return [node] * (len(ops) - start)
        by_pool: dict[int, _NodePass] = {}
        out = []
        for i in range(start, len(ops)):
            try:
                pool = self._client.get_redis_connection(self._client.get_node_from_key(ops[i].key)).connection_pool
            except Exception as exc:  # a slot no node serves
                node = _NodePass(None, exc)
            else:
                node = by_pool.setdefault(id(pool), _NodePass(pool))
            node.todo.append(i)
            out.append(node)
        return out

    def _may_refresh(self) -> bool:
        return time.monotonic() - self._refreshed_at >= _REFRESH_EVERY_S

    def _refresh(self, since: int | None = None) -> None:
        """Reread a cluster's slot map if a call found it stale (at most once a second). If no
        node answers, the old map stays (its live nodes still serve their slots). With `since`
        (the map's `_epoch` when a lane's pass began, which then met a redirect) it waits for
        another lane's reread under way (at most a second, never past the call's deadline),
        and rereads only if none came since."""
        if since is None and (not self._stale or not self._may_refresh()):
            return
        wait, end = 0.0, self._deadline()
        if since is not None:
            wait = _REFRESH_EVERY_S if end is None else max(0.0, min(_REFRESH_EVERY_S, end - time.monotonic()))
        if not self._refreshing.acquire(timeout=wait):
            return  # another lane is rereading it: this one goes on with the map it has
        try:
            if since is not None and (self._epoch != since or not self._may_refresh()):
                return  # reread since this lane's pass began (or just now: rate-limited)
            self._refreshed_at = time.monotonic()
            self._client.nodes_manager.initialize()
            self._stale = False
            self._epoch += 1
        except Exception:  # the commands that follow fail or succeed on their own, counted
            return
        finally:
            self._refreshing.release()

    def run(self, ops: Sequence[Op], on_reply: OnReply, buffer_for: BufferFor | None = None) -> list[Any]:
        """Send `ops` and pass each reply, in order, to `on_reply`, until it returns False.
        Returns one entry per reply passed: the exception (an error reply or what ended its
        connection) or True. In a cluster, the first MOVED/ASK of a call makes it reread the
        slot map (at most once a second; not again if another lane of the call did since
        this one began, which it waits for) and send the rest again; a second is passed on
        as an error."""
        outcomes: list[Any] = []
        if self._cluster:
            self._refresh()
        epoch = self._epoch
        moved = self._pass(ops, 0, on_reply, buffer_for or _drop, outcomes, self._cluster)
        if moved is not None:
            self._refresh(since=epoch)
            self._pass(ops, moved, on_reply, buffer_for or _drop, outcomes, False)
        return outcomes

    def _pass(self, ops: Sequence[Op], start: int, on_reply: OnReply, buffer_for: BufferFor, outcomes: list[Any],
              follow: bool) -> int | None:
        """Stream `ops[start:]`; with `follow`, a redirect ends the pass unreported and its index
        is returned (None otherwise)."""
        node_of = self._node_passes(ops, start)
        nodes = list({id(node): node for node in node_of}.values())
        try:
            for node in nodes:
                if node.error is None:
                    node.open()
            for i in range(start, len(ops)):
                for node in nodes:
                    node.fill(ops, self._window_bytes)
                reply = node_of[i - start].read(ops[i], buffer_for)
                failed = isinstance(reply, Exception)
                if failed and self._cluster and (not isinstance(reply, ReplyError) or reply.is_redirect):
                    self._stale = True  # a dead node or a moved slot: the slot map may be out of date
                    if follow and isinstance(reply, ReplyError):
                        return i
                outcomes.append(reply if failed else True)
                if not on_reply(i, reply):
                    break
        finally:
            for node in nodes:
                node.finish(ops)
        return None
