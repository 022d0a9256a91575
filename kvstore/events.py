"""KV events: a store announces which blocks enter and leave each of its tiers.

Transport: ZeroMQ PUB/SUB with msgpack (the family of vLLM's `--kv-events-config`). The
publisher binds `events_endpoint`; subscribers (`kvstrata router`) connect. Every message is
three frames, `[b"kvstrata", seq (8 bytes big-endian), payload]`; `seq` counts batches from 1
per publisher *epoch* (a random id drawn when the store opens), so a subscriber sees a gap,
or a restarted instance, and asks for a snapshot. The payload is a map:

    {"v": 1, "src": {...}, "ev": [[op, tier, hashes], ...]}

`src` (`EventSource.to_wire`) names the instance and everything a router needs to hash a
query as this store does (namespace seed, hash algorithm, block size), plus the remote tier
it shares with other instances. `op` is "stored", "removed" or "cleared", `tier` one of
"pool", "cpu", "disk", "remote", and `hashes` the block digests concatenated. A batch with no
events is a heartbeat (one a second).

Snapshots: a ROUTER socket on `snapshot_endpoint(events_endpoint)` (the port after the events
port; `<path>.snapshot` for ipc) answers the request `[b"snapshot"]` with
`[b"snapshot", seq, {"v", "src", "tiers": {tier: hashes}}]`: every block each tier holds
(disk included, so a restarted instance announces its warm disk), consistent with the event
stream up to and including batch `seq`.

Publishing runs on its own thread: the tiers only append to a list under a lock. It never
blocks or fails a store call; if the list outgrows its bound, the events are dropped and the
sequence skips a number, so subscribers resynchronise from a snapshot.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack

from kvstore.errors import ConfigError
from tiers.base import BlockHash, TierKind

logger = logging.getLogger(__name__)

TOPIC = b"kvstrata"
SNAPSHOT_REQUEST = b"snapshot"
WIRE_VERSION = 1
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
HEARTBEAT_S = 1.0
_FLUSH_S = 0.02
_MAX_PENDING = 1_000_000  # block hashes waiting to be sent


def check_endpoint(endpoint: object, name: str = "events_endpoint") -> str:
    """`endpoint` if it is `tcp://HOST:PORT` (PORT below 65535) or `ipc://PATH`, else a
    `ConfigError` naming it."""
    if isinstance(endpoint, str):
        if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
            return endpoint
        if endpoint.startswith("tcp://"):
            try:
                parts = urlsplit(endpoint)
                port = parts.port
            except ValueError:
                port = None
            if parts.hostname and port is not None and 0 < port < 65535:
                return endpoint
    raise ConfigError(f"{name} must be 'tcp://HOST:PORT' or 'ipc://PATH', got {endpoint!r}")


def snapshot_endpoint(endpoint: str) -> str:
    """Where the publisher of `endpoint` answers snapshot requests: the next TCP port, or
    `<path>.snapshot` for an ipc endpoint."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".snapshot"
    parts = urlsplit(endpoint)
    assert parts.port is not None
    host = parts.netloc.rsplit(":", 1)[0]
    return f"tcp://{host}:{parts.port + 1}"


def split_hashes(blob: bytes, digest_bytes: int) -> list[bytes]:
    """The digests of a concatenated `hashes` field."""
    if digest_bytes <= 0 or len(blob) % digest_bytes:
        raise ValueError(f"{len(blob)} bytes of hashes are not a multiple of {digest_bytes}")
    return [blob[i : i + digest_bytes] for i in range(0, len(blob), digest_bytes)]


@dataclass(frozen=True)
class EventSource:
    """Who publishes, and how to hash a query the way it does.

    Attributes:
        instance_id: the engine instance (unique in a fleet).
        model: a short model label for `/lookup`'s `model` filter.
        seed: the store's namespace seed (root of its hash chains).
        algo: hash algorithm name ("xxh3_128" or "sha256").
        block_size: tokens per block.
        remote: the shared remote tier, credentials removed (None without one): instances
            naming the same one can all serve its blocks.
        epoch: random id of this publisher's lifetime.
    """

    instance_id: str
    model: str
    seed: bytes
    algo: str
    block_size: int
    remote: str | None
    epoch: int

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.instance_id, "model": self.model, "seed": self.seed, "algo": self.algo,
                "bs": self.block_size, "remote": self.remote, "epoch": self.epoch}

    @classmethod
    def from_wire(cls, value: object) -> EventSource:
        """Parse `to_wire`'s map; `ValueError` if malformed."""
        if not isinstance(value, dict):
            raise ValueError("src is not a map")
        try:
            src = cls(str(value["id"]), str(value["model"]), bytes(value["seed"]), str(value["algo"]),
                      int(value["bs"]), None if value["remote"] is None else str(value["remote"]), int(value["epoch"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed src: {exc}") from None
        if src.block_size <= 0 or src.algo not in ("xxh3_128", "sha256"):
            raise ValueError(f"malformed src: block size {src.block_size}, algorithm {src.algo!r}")
        return src


Snapshot = Callable[[], tuple[dict[TierKind, list[BlockHash]], list[list[Any]]]]


class EventPublisher:
    """Publishes one store's KV events on `endpoint` and answers snapshot requests.

    `on_change` is the tiers' listener; `snapshot()` returns every tier's held blocks and the
    events not yet sent (taken atomically with them, under the store's lock), so a snapshot
    is exact as of the batch it names. Bind failures raise `ConfigError` at construction.
    """

    def __init__(self, endpoint: str, source: EventSource, snapshot: Snapshot) -> None:
        import zmq

        self.endpoint = check_endpoint(endpoint)
        self.source = source
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._pending: list[list[Any]] = []
        self._pending_hashes = 0
        self._seq = 0
        self._closed = threading.Event()
        self.num_batches = self.num_dropped = self.num_snapshots = 0
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._rep = ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._rep):
            sock.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._pub.bind(self.endpoint)
            self._rep.bind(snapshot_endpoint(self.endpoint))
        except zmq.ZMQError as exc:
            self._pub.close()
            self._rep.close()
            raise ConfigError(f"events_endpoint {endpoint!r} (and {snapshot_endpoint(endpoint)!r} for snapshots) "
                              f"cannot be bound: {exc}") from None
        self._pid = os.getpid()
        # The sockets move to the thread: from here on only it touches them.
        self._thread = threading.Thread(target=self._run, name="kvstrata-events", daemon=True)
        self._thread.start()

    # -- called by the tiers (any thread) -------------------------------------------------
    def on_change(self, kind: TierKind, stored: bool, block_hashes: Sequence[BlockHash]) -> None:
        """Queue an event; never blocks on the network, never raises."""
        if os.getpid() != self._pid:  # a forked child: the sockets are the parent's
            return
        blob = b"".join(block_hashes)
        with self._lock:
            if self._pending_hashes + len(block_hashes) > _MAX_PENDING:
                self._drop_pending()
                return
            self._pending.append([STORED if stored else REMOVED, kind.value, blob])
            self._pending_hashes += len(block_hashes)

    def on_clear(self, kind: TierKind) -> None:
        """Queue "tier `kind` was emptied"."""
        with self._lock:
            self._pending.append([CLEARED, kind.value, b""])

    def _drop_pending(self) -> None:
        """Lose the queued events and skip a sequence number (caller holds `_lock`)."""
        self.num_dropped += self._pending_hashes
        self._pending, self._pending_hashes = [], 0
        self._seq += 1  # subscribers see a gap and resynchronise
        logger.warning("kvstrata: KV events queue overflowed; subscribers will resynchronise from a snapshot")

    def take_pending(self) -> list[list[Any]]:
        """Remove and return the queued events (the store's snapshot calls this under its lock)."""
        with self._lock:
            pending, self._pending, self._pending_hashes = self._pending, [], 0
        return pending

    # -- the publisher thread -------------------------------------------------------------
    def _send(self, events: list[list[Any]]) -> None:
        self._seq += 1
        payload = msgpack.packb({"v": WIRE_VERSION, "src": self.source.to_wire(), "ev": events}, use_bin_type=True)
        self._pub.send_multipart([TOPIC, self._seq.to_bytes(8, "big"), payload], copy=False)
        self.num_batches += 1

    def _answer_snapshot(self) -> None:
        import zmq

        frames = self._rep.recv_multipart()
        if frames[-1] != SNAPSHOT_REQUEST:
            return
        held, pending = self._snapshot()
        if pending:
            self._send(pending)  # events before the snapshot: already in it, numbered before it
        tiers = {kind.value: b"".join(hashes) for kind, hashes in held.items()}
        payload = msgpack.packb({"v": WIRE_VERSION, "src": self.source.to_wire(), "tiers": tiers},
                                use_bin_type=True)
        try:
            self._rep.send_multipart([*frames[:-1], SNAPSHOT_REQUEST, self._seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK)
            self.num_snapshots += 1
        except zmq.ZMQError:
            pass  # the requester went away

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._rep, zmq.POLLIN)
        last = 0.0
        try:
            while not self._closed.is_set():
                try:
                    if dict(poller.poll(int(_FLUSH_S * 1000))).get(self._rep):
                        self._answer_snapshot()
                    events = self.take_pending()
                    now = time.monotonic()
                    if events or now - last >= HEARTBEAT_S:
                        self._send(events)
                        last = now
                except Exception as exc:  # a publisher fault never reaches the store
                    logger.warning("kvstrata: KV events: %s: %s", type(exc).__name__, exc)
                    time.sleep(_FLUSH_S)
            events = self.take_pending()
            if events:
                self._send(events)
        finally:
            self._pub.close(linger=200)
            self._rep.close(linger=0)

    def close(self) -> None:
        """Send what is queued, stop the thread and unbind. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if os.getpid() == self._pid:
            self._thread.join(timeout=5)


def new_epoch() -> int:
    return secrets.randbits(62)
