"""Walking a live server's keys by pattern, and deleting some: resumable, bounded rounds.

SCAN walks each node's keyspace with a cursor. Here each round (one SCAN of `count` slots,
then one pipelined UNLINK of the keys it matched that must go) is a call of its own, with its
own deadline, and the cursor carries on from round to round: a server that holds millions
of other keys costs one pass over them, never a restart from cursor 0. The whole walk is
bounded by `budget_s`; a walk that runs out of time or meets a fault stops and says so
(`complete` False) with what it did. A cluster is walked one primary at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from tiers.base import SweepResult

# (what, bytes moved, fn(client), reply bytes) -> fn's result; None for a fault (counted by the caller)
Call = Callable[[str, int, Callable[[Any], Any], int], Any]

KEY_BYTES = 1024  # the longest key a round may return, on average, within its bound
_COMMAND_BYTES = 64  # an UNLINK's bytes beside its key, and its reply


def _nodes(client: Any) -> list[Any]:
    """A client per node to walk: each primary of a cluster, or the server itself."""
    if hasattr(client, "get_primaries"):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


class Walk:
    """Pages of the keys that match `pattern`, one SCAN round each, until every node was walked
    (`complete`), `budget_s` passed (at least one round runs) or a call faulted."""

    def __init__(self, call: Call, pattern: bytes, *, count: int, budget_s: float) -> None:
        self._call = call
        self._pattern = pattern
        self._count = count
        self._budget_s = budget_s
        self.complete = False

    def __iter__(self) -> Iterator[tuple[Any, list[bytes]]]:
        """(node, keys) for each round."""
        end = time.monotonic() + self._budget_s
        nodes = self._call("list nodes", _COMMAND_BYTES, _nodes, _COMMAND_BYTES)
        if nodes is None:
            return
        rounds = 0
        for node in nodes:
            cursor = 0
            while True:
                if rounds and time.monotonic() >= end:
                    return
                rounds += 1
                reply_bytes = self._count * KEY_BYTES
                reply = self._call("scan", reply_bytes, self._scan(node, cursor), reply_bytes)
                if reply is None:
                    return
                cursor, keys = reply
                yield node, [k for k in keys if isinstance(k, bytes)]
                if not cursor:
                    break
        self.complete = True


    def _scan(self, node: Any, cursor: int) -> Callable[[Any], Any]:
        return lambda _: node.scan(cursor, match=self._pattern, count=self._count)


def _unlink(node: Any, keys: list[bytes]) -> Callable[[Any], list[Any]]:
    """A call that UNLINKs `keys` on `node`, one pipelined command a key."""
    return lambda _: _unlink_now(node, keys)


def _unlink_now(node: Any, keys: list[bytes]) -> list[Any]:
    pipe = node.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)  # one key a command: a cluster refuses keys of several slots together
    return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]


def sweep(call: Call, pattern: bytes, doomed: Callable[[bytes], bool], *, count: int, budget_s: float) -> SweepResult:
    """Delete (UNLINK) every key that matches `pattern` for which `doomed(key)` holds, walking
    as `Walk` does. Incomplete if the walk was, or a delete faulted."""
    walk = Walk(call, pattern, count=count, budget_s=budget_s)
    deleted = 0
    for node, keys in walk:
        gone = [k for k in keys if doomed(k)]
        if not gone:
            continue
        nbytes = sum(len(k) + _COMMAND_BYTES for k in gone)
        replies = call("delete", nbytes, _unlink(node, gone), _COMMAND_BYTES * len(gone))
        deleted += sum(r for r in replies or [] if isinstance(r, int) and not isinstance(r, bool))
        if replies is None or any(isinstance(r, Exception) for r in replies):
            return SweepResult(deleted, False)
    return SweepResult(deleted, walk.complete)


def unfinished(result: SweepResult, renewed: bool, all_namespaces: bool) -> str:
    """What an incomplete clear left, and what that means, for its warning."""
    what = "kvstrata's keys of every namespace" if all_namespaces else "this namespace's old blocks"
    if not renewed:
        why = "the namespace's generation could not be changed: blocks left may still be read"
    else:
        why = ("the blocks left are of an old generation, which no reader of this namespace finds"
               + ("; other namespaces' blocks left may still be read" if all_namespaces else "")
               + "; the server's LRU, their TTL or the next clear removes them")
    return f"clear() deleted {result.num_deleted} keys but not all of {what} (out of time or a fault); {why}"
