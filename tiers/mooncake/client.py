"""The Mooncake tier's connection: the store client, imported and set up lazily, its
registered transfer buffer, and every call bounded and counted.

A call leases a region of the registered buffer (`Connection.lease`); the caller fills it
(records encoded from its tensors) and `Connection.run` makes the native call on a worker
thread (`tiers/mooncake/calls.py`) within `timeout_s + nbytes / min_rate_bps`; the caller then
reads the region (validation, copies into its tensors). Only the caller's thread touches its
tensors, so nothing of a call that passed its deadline ever reaches them, and the region stays
leased until the abandoned call returns. Faults (the deadline, an error code
the tier treats as one, no client) are counted in the kind's `Health` (`tiers/shared/health.py`)
with a rate-limited warning; repeated ones open its breaker for `cooldown_s`. A client that
could not be set up (the master down) is set up again by a later call, once its breaker lets
calls through. A process forked from one that set up a client never sets one up (`_SetUps`):
each of its calls is a counted fault at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tiers.errors import ConfigError
from tiers.mooncake.calls import CallFailed, Regions, Workers
from tiers.shared.forks import renew_in_child
from tiers.shared.health import Health

logger = logging.getLogger("tiers.mooncake.tier")

R = TypeVar("R")
NUM_REGIONS = 2  # calls in flight at once, each with its own part of the transfer buffer
NUM_WORKERS = 4
PROBE_S = 2.0  # each step of a probe of the master before a setup, at most
_NOT_AN_RPC = bytes(64)  # a bad RPC header: a live master closes the connection
_HTTP_PROBE = b"GET / HTTP/1.0\r\n\r\n"
FORKED = ("this process is a fork of one that set up a Mooncake client, and Mooncake cannot set up a client "
          "in such a child (its setup hangs): open the Mooncake tier in a process that is not a fork of one that "
          "set up a Mooncake client (e.g. start workers with the 'spawn' method)")
EXTRA = ("pip install 'kvstrata[mooncake]' (the Mooncake store client; it needs libibverbs1: "
         "apt-get install libibverbs1)")


class Fault(Exception):
    """A native call answered with an error the tier counts as a fault (not a plain miss)."""


def store_class() -> Any:
    """Mooncake's `MooncakeDistributedStore`; `ConfigError` naming the extra if it is not installed."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError(f"the mooncake tier needs the Mooncake store client: {EXTRA} ({exc})") from None
    return MooncakeDistributedStore


@dataclass(frozen=True)
class ClientParams:
    """What `MooncakeDistributedStore.setup` takes (see `MooncakeTierConfig`)."""

    local_hostname: str
    metadata_server: str
    segment_bytes: int
    local_buffer_bytes: int
    protocol: str
    device_name: str
    master: str


class Lease:
    """One region of the transfer buffer, held by the caller and by each native call made with
    it until all let go (a call that passed its deadline holds it until it returns)."""

    def __init__(self, regions: Regions, region: int) -> None:
        self.region = region
        self.address = regions.address_of(region)
        self.view = regions.view(region)
        self._regions = regions
        self._holders = 1
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def drop(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._regions.give(self.region)


_ORPHANS: list[tuple[Any, Regions]] = []  # a forked child's copies of its parent's clients


class _SetUps:
    """Whether this process began to set up a native client (`here`), and whether an ancestor
    did before it forked this process or a parent of it (`ancestor`). Mooncake's `setup` hangs
    in such a child, holding the interpreter's lock (no deadline bounds it), and a client
    set up before the fork is never answered there: its connections never set one up."""

    def __init__(self) -> None:
        self.here = self.ancestor = False
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.ancestor, self.here = self.ancestor or self.here, False


_SET_UPS = _SetUps()


class _Idle:
    """Set-up clients with their registered buffers that no open tier uses, by what they were
    set up with: a tier that opens takes one instead of setting up its own. Mooncake's
    `close` holds the interpreter's lock for a second or more (many with the master down), so
    a tier's close never calls it: its client waits here and is closed at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[ClientParams, int], list[tuple[Any, Regions]]] = {}
        # regions held by abandoned calls: reused once every region is free again
        self._held: dict[tuple[ClientParams, int], list[tuple[Any, Regions]]] = {}
        self._kept: list[tuple[Any, Regions]] = []  # clients that failed their setup: never reused
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: the parent's clients are not this process's; they are neither
        reused nor closed (only kept referenced: their destructor would close them)."""
        self._lock = threading.Lock()
        _ORPHANS.extend([*(c for pool in (self._idle, self._held) for found in pool.values() for c in found),
                         *self._kept])
        self._idle, self._held, self._kept = {}, {}, []

    def take(self, key: tuple[ClientParams, int]) -> tuple[Any, Regions] | None:
        """An idle client of `key` with its buffer, one whose abandoned calls have all returned
        since, or None."""
        with self._lock:
            found = self._idle.get(key)
            if found:
                return found.pop()
            held = self._held.get(key, [])
            for i, (_, regions) in enumerate(held):
                if regions.num_free == NUM_REGIONS:
                    return held.pop(i)
            return None

    def give(self, key: tuple[ClientParams, int], client: Any, regions: Regions) -> None:
        with self._lock:
            pool = self._idle if regions.num_free == NUM_REGIONS else self._held
            pool.setdefault(key, []).append((client, regions))

    def keep(self, client: Any, regions: Regions) -> None:
        """A client that is never handed to a tier (its setup failed): closed at exit."""
        with self._lock:
            self._kept.append((client, regions))

    def close_all(self) -> None:
        with self._lock:
            clients = [c for pool in (self._idle, self._held) for found in pool.values() for c, _ in found]
            clients += [c for c, _ in self._kept]
            self._idle.clear()
            self._held.clear()
            self._kept.clear()
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()


_IDLE = _Idle()
atexit.register(_IDLE.close_all)


def close_idle() -> None:
    """Close the clients no open tier uses (each takes a second or more; many with its master
    down, so close them while it runs)."""
    _IDLE.close_all()


class Connection:
    """One tier's client and its calls."""

    def __init__(self, params: ClientParams, *, timeout_s: float, min_rate_bps: float, cooldown_s: float,
                 setup_timeout_s: float, region_bytes: int) -> None:
        self._cls = store_class()
        self.params = params
        self._timeout_s = timeout_s
        self._min_rate_bps = min_rate_bps
        self._setup_timeout_s = setup_timeout_s
        self.reads, self.writes = Health("read", cooldown_s, logger), Health("write", cooldown_s, logger)
        self._key = (params, region_bytes)
        idle = _IDLE.take(self._key)
        self._client: Any = None if idle is None else idle[0]
        self.regions = Regions(NUM_REGIONS, region_bytes) if idle is None else idle[1]
        self._workers = Workers(NUM_WORKERS, "kvstrata-mooncake")
        self._setup_lock = threading.Lock()
        self._cooldown_s = cooldown_s
        self._next_setup = 0.0
        renew_in_child(self, "_setup_lock")

    def _after_fork(self) -> None:
        """In a forked child: the parent's client is not this process's (its calls are never
        answered: each would wait out its deadline and hold a region and a worker for ever);
        it is kept, never closed, and every call is a counted fault at once (`_SetUps`)."""
        if self._client is not None:
            _ORPHANS.append((self._client, self.regions))
            self._client = None

    def limit(self, nbytes: int) -> float:
        """The deadline of a call moving `nbytes`."""
        return self._timeout_s + nbytes / self._min_rate_bps

    def _setup(self) -> Any:
        p = self.params
        client = self._cls()
        _SET_UPS.here = True  # a fork from now on, even mid-setup, leaves a child that cannot set one up
        rc = client.setup(p.local_hostname, p.metadata_server, p.segment_bytes, p.local_buffer_bytes, p.protocol,
                          p.device_name, p.master)
        if rc != 0:
            raise Fault(f"setup returned {rc}")
        rc = client.register_buffer(self.regions.address, self.regions.nbytes)
        if rc != 0:
            _IDLE.keep(client, self.regions)  # never reused: closed at exit
            raise Fault(f"register_buffer returned {rc}")
        return client

    def _probe(self) -> None:
        """Ask the master and an HTTP metadata server for an answer (plain sockets, each step
        within `setup_timeout_s`, `PROBE_S` at most); `CallFailed` if one gives none. Mooncake's
        `setup` holds the interpreter's lock while it waits on a master that is down or hung
        (minutes), so no worker could bound it: it is only called once both answer. A connect
        alone is no answer (the kernel accepts for a stopped process): the master is sent bytes
        that are no RPC, which it answers by closing; the HTTP server, a request."""
        host, _, port = self.params.master.rpartition(":")
        ends = [(host.strip("[]"), int(port), _NOT_AN_RPC)]
        url = urllib.parse.urlsplit(self.params.metadata_server)
        with contextlib.suppress(ValueError):
            if url.scheme in ("http", "https") and url.hostname:
                ends.append((url.hostname, url.port or (443 if url.scheme == "https" else 80), _HTTP_PROBE))
        for end_host, end_port, ask in ends:
            try:
                with socket.create_connection((end_host, end_port), timeout=min(self._setup_timeout_s, PROBE_S)) as s:
                    s.sendall(ask)
                    s.recv(1)  # bytes, or b"" (closed): an answer
            except OSError as exc:
                raise CallFailed(f"{end_host}:{end_port} does not answer ({exc})") from None

    def _connected(self) -> Any:
        """The client, set up first (within `setup_timeout_s`) if there is none yet; after a
        failed setup none is tried for `cooldown_s`, and none ever in a fork of a process that
        set one up (`CallFailed` at once)."""
        with self._setup_lock:
            if self._client is None:
                if _SET_UPS.ancestor:
                    raise CallFailed(FORKED)
                if time.monotonic() < self._next_setup:
                    raise CallFailed("no client: its last setup failed (the master down?); retried later")
                try:
                    self._probe()
                    self._client = self._workers.run(self._setup, self._setup_timeout_s)
                except CallFailed:
                    self._next_setup = time.monotonic() + self._cooldown_s
                    raise
            return self._client

    def connect(self, health: Health) -> bool:
        """Set the client up now if it is not; False (a counted fault) if that failed."""
        try:
            self._connected()
        except CallFailed as exc:
            self.fault(health, "setup", exc)
            return False
        return True

    def lease(self, health: Health, what: str) -> Lease | None:
        """A region of the transfer buffer for a call (the caller drops it); None (a counted
        fault) if the breaker of `health` is open or every region is held by abandoned calls."""
        if not health.available():
            return None
        region = self.regions.take()
        if region is None:
            self.fault(health, what, CallFailed("every region of the transfer buffer is held by calls that passed "
                                                "their deadline"))
            return None
        return Lease(self.regions, region)

    def run(self, health: Health, what: str, nbytes: int, native: Callable[[Any], R], lease: Lease) -> R | None:
        """`native(client)` on a worker within the deadline for `nbytes`, holding `lease` while
        it runs; its result, or None (a counted fault) if the client cannot be set up, no
        worker is free, the deadline passes or `native` raised (`Fault`: an error code)."""
        try:
            client = self._connected()
            lease.hold()
            result = self._workers.run(lambda: native(client), self.limit(nbytes), release=lease.drop)
        except CallFailed as exc:
            self.fault(health, what, exc)
            return None
        health.ok()
        return result

    def fault(self, health: Health, what: str, exc: BaseException) -> None:
        health.fault(f"mooncake tier (master {self.params.master}): {what} failed ({exc}); treated as a miss")

    def close(self) -> None:
        """Stop the workers; the client, with its buffer, waits for the next tier of the same
        setup (`_Idle`)."""
        self._workers.close()
        if self._client is not None:
            _IDLE.give(self._key, self._client, self.regions)
            self._client = None
