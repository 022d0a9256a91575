"""The KV-event publisher: a store announces which blocks enter and leave each of its tiers,
in vLLM's wire format (`kvevents/wire.py`), so `kvstrata router`, Dynamo and llm-d can index it.

The publisher binds an XPUB socket on `events_endpoint` and a ROUTER socket on the replay
endpoint. It is handed the tiers' changes (`publish`, from any thread, in the order they
happened), or pulls them itself (its `poll`, every 20 ms, so what tiers do in the background
goes out too): it updates its mirror (`kvevents/mirror.py`) and queues them under its own
lock (never the store's); its thread sends the queue as a batch every 20 ms, and an empty
batch as a heartbeat every second.

Whole state, never under the store's lock: when a reader subscribes (XPUB tells the
publisher) and when the store opens, the publisher broadcasts "welcome" batches: vLLM's
`AllBlocksCleared` (readers forget all this store announced, in any lifetime; they keep each
source's apart, so no other store's), then every mirrored block, parents first, with token
ids (a store reopened over a warm disk announces what it holds, not what it lost while down).
Welcomes are coalesced, at most one a second; a replay request for batches still in the
replay buffer gets them, an older one the same whole state, rate-limited per peer and overall
(a refused one gets only the end marker). Every whole state is paid for in time: after one of
B bytes the next waits B / `WHOLE_STATE_BYTES_PER_S` s, however often readers subscribe. If
the queue outgrows its bound, it is dropped for a welcome; so is a tier's change log that
overflowed (a `RESYNC`: the tier's blocks are restated in the mirror first).

Batch numbers count up from the publisher's start time in microseconds: a restarted store's
are above its last lifetime's, so readers that drop a batch numbered at or below the last one
they applied (Dynamo's indexer) take its welcome.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvevents.config import EventSource, PublisherConfig
from kvevents.mirror import Mirror, root_first
from kvevents.ratelimit import TokenBuckets
from kvevents.wire import (
    END_SEQ,
    MEDIA,
    cleared_event,
    cut,
    encode_batch,
    is_local,
    removed_event,
    stored_events,
)
from tiers.changes import ChangeKind, TierChange
from tiers.errors import ConfigError
from tiers.keys import BlockKey, TierKind

logger = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
WELCOME_INTERVAL_S = 1.0
WHOLE_STATE_BYTES_PER_S = 8 << 20  # whole states (welcomes, snapshot replays) sent, at most, on average
_FLUSH_S = 0.02
_MAX_PENDING = 1_000_000  # blocks waiting to be sent
_REPLAY_BATCHES, _REPLAY_BYTES = 4096, 64 << 20
_BIT = {medium: 1 << i for i, medium in enumerate(MEDIA)}


class EventPublisher:
    """Publishes one store's KV events and answers replay requests; see the module
    docstring. `poll`, when given, is called on the publisher's thread every 20 ms to hand it
    the changes made since (it must not raise or block for long). Bind failures raise
    `ConfigError` at construction."""

    def __init__(self, config: PublisherConfig, source: EventSource, media: Mapping[TierKind, str],
                 warm: Iterable[tuple[BlockKey, str]] = (), poll: Callable[[], None] | None = None) -> None:
        import zmq

        self.config, self.source = config, source
        self._poll = poll
        self._media = dict(media)  # each tier's medium (`events_wire.medium_of` its traits)
        self._lock = threading.Lock()
        self._mirror = Mirror(config.max_mirror_blocks)
        for key, medium in warm:  # a warm persistent tier, announced by the first welcome
            self._mirror.stored(_BIT[medium], key)
        self._pending: list[tuple[str, bool | None, list[Any]]] = []
        self._num_pending = 0
        self._welcome_due = True
        self._heard = False  # a reader has subscribed (before, a welcome reaches no one: it costs no pacing)
        self._next_whole = 0.0  # monotonic time before which no whole state is built again
        self._seq = time.time_ns() // 1000 - 1  # above any earlier lifetime's (see the module docstring)
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_bytes = 0
        self._drop_buffer = threading.Event()  # drop_replay_buffer(): the publisher thread empties it
        self._closed = threading.Event()
        self.num_batches = self.num_dropped = self.num_welcomes = self.num_resyncs = 0
        self.num_replays = self.num_snapshots = self.num_refused = self.num_bad_requests = 0
        self._peers = TokenBuckets(rate=0.2, burst=2, max_peers=1024)  # snapshots per peer
        self._overall = TokenBuckets(rate=1.0, burst=4, max_peers=1)  # snapshots in all
        self._replay_peers = TokenBuckets(rate=20.0, burst=50, max_peers=1024)  # buffered replays per peer
        # A context of its own: terminating it waits until the sockets are unbound, so a store
        # reopened in this process can bind the same endpoint at once.
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._auth = config.curve.start_authenticator(self._ctx) if config.curve else None
        self._pub, self._rep = self._ctx.socket(zmq.XPUB), self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._rep):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, 1024)  # inbound: subscriptions and replay requests
            if config.curve:
                config.curve.secure(sock)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, so every reader is welcomed
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._rep.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if config.connect:
                self._pub.connect(config.endpoint)
            else:
                self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._rep.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._shutdown_sockets()
            raise ConfigError(f"events_endpoint {config.endpoint!r} (and {config.replay_endpoint!r} for replay) "
                              f"cannot be bound: {exc}") from None
        listening = [e for e in (None if config.connect else config.endpoint, config.replay_endpoint) if e]
        if not config.curve and not all(is_local(e) for e in listening):
            logger.warning("kvstrata: KV events on %s are unauthenticated and reachable from other hosts: anyone "
                           "who connects reads every block's token ids (docs/security.md)", config.endpoint)
        self._pid = os.getpid()
        # The sockets move to the thread: from here on only it touches them.
        self._thread = threading.Thread(target=self._run, name="kvstrata-events", daemon=True)
        self._thread.start()

    # -- called by whoever drains the tiers (any thread); never block, never raise ----------
    def publish(self, changes: Iterable[TierChange]) -> None:
        """Mirror and queue `changes` (what entered and left the store's tiers, oldest first).
        A block that entered is announced with its key; one known only by its hash is
        described from the mirror, else counted (`Mirror.num_undescribed`) and left out. A
        `RESYNC` restates its tier in the mirror and calls for a welcome. Changes of a tier
        the publisher was not told of are ignored."""
        if os.getpid() != self._pid:  # a forked child: the sockets are the parent's
            return
        with self._lock:
            for change in changes:
                medium = self._media.get(change.tier)
                if medium is None:
                    continue
                bit = _BIT[medium]
                if change.kind is ChangeKind.ENTERED:
                    full = [f for f in (self._mirror.stored(bit, k) for k in change.keys) if f is not None]
                    if full:
                        self._queue(medium, True, full)
                elif change.kind is ChangeKind.LEFT:
                    for key in change.keys:
                        self._mirror.removed(bit, key.block_hash)
                    self._queue(medium, False, [k.block_hash for k in change.keys])
                elif change.kind is ChangeKind.CLEARED:
                    self._mirror.cleared(bit)
                    self._queue(medium, None, [])
                else:  # RESYNC: what readers were told of this tier is unknown; the welcome restates all
                    self._mirror.restate(bit, change.keys)
                    self._welcome_due = True
                    self.num_resyncs += 1

    def _queue(self, medium: str, stored: bool | None, items: list[Any]) -> None:
        """Queue one change (caller holds `_lock`); an overflowing queue becomes a welcome."""
        if self._num_pending + len(items) > _MAX_PENDING:
            self.num_dropped += self._num_pending + len(items)
            # clears are kept (a welcome clears all anyway): their order with what follows matters
            self._pending = [p for p in self._pending if p[1] is None]
            self._num_pending, self._welcome_due = 0, True
            logger.warning("kvstrata: KV events queue overflowed; the whole state will be published instead")
            return
        self._pending.append((medium, stored, items))
        self._num_pending += len(items)

    @property
    def inbound_limits(self) -> tuple[int, int]:
        """The largest message, in bytes, the events and the replay socket take from a peer
        (a larger one drops that peer); reads the sockets' options, changes nothing."""
        import zmq

        return int(self._pub.getsockopt(zmq.MAXMSGSIZE)), int(self._rep.getsockopt(zmq.MAXMSGSIZE))

    @property
    def num_unmirrored(self) -> int:
        return self._mirror.num_unmirrored

    def drop_replay_buffer(self) -> None:
        """Forget the batches kept for replay, before the next replay request is answered: a
        reader asking for any of them then gets the whole state instead."""
        self._drop_buffer.set()

    # -- the publisher thread -------------------------------------------------------------
    def _events(self, pending: list[tuple[str, bool | None, list[Any]]]) -> list[dict[str, Any]]:
        """Events of queued changes, in order; each run of consecutive stores is ordered
        parents first (tiers report a sequence tail first, and a block's parent may enter
        another tier in the same run)."""
        meta, src = self.source.meta(), self.source
        out: list[dict[str, Any]] = []
        run: list[tuple[BlockKey, str]] = []
        end: list[Any] = []  # marks the end of the queue
        for medium, stored, items in [*pending, ("", None, end)]:
            if stored:
                run.extend((k, medium) for k in items)
                continue
            if run:
                out.extend(stored_events(parents_first(run), src.seed, src.block_size, meta))
                run = []
            if items is end:
                break
            out.append(cleared_event([medium], meta) if stored is None else removed_event(items, medium, meta))
        return out

    def _whole_state(self) -> list[dict[str, Any]]:
        """`AllBlocksCleared` (all this store announced), then every mirrored block, parents
        first (the caller sends the queued events before it)."""
        with self._lock:
            blocks = self._mirror.copy()
        items = ((key, medium) for key, bits in root_first(blocks, self.source.seed)
                 for medium in MEDIA if bits & _BIT[medium])
        meta = self.source.meta()
        stored = stored_events(items, self.source.seed, self.source.block_size, meta)
        return [cleared_event(None, meta), *stored]

    def _send(self, events: list[dict[str, Any]]) -> int:
        """Publish `events` in batches; the bytes sent."""
        sent = 0
        for group in cut(events) or [[]]:
            self._seq += 1
            payload = encode_batch(group)
            self._pub.send_multipart([self.config.topic, self._seq.to_bytes(8, "big"), payload], copy=False)
            self._buffer.append((self._seq, payload))
            self._buffer_bytes += len(payload)
            sent += len(payload)
            while len(self._buffer) > _REPLAY_BATCHES or self._buffer_bytes > _REPLAY_BYTES:
                self._buffer_bytes -= len(self._buffer.popleft()[1])
            self.num_batches += 1
        return sent

    def _paid(self, nbytes: int) -> None:
        """Pace whole states: the next waits until `nbytes` are paid for at the set rate."""
        if self._heard:
            self._next_whole = time.monotonic() + nbytes / WHOLE_STATE_BYTES_PER_S

    def _answer_replay(self) -> None:
        if self._drop_buffer.is_set():
            self._drop_buffer.clear()
            self._buffer.clear()
            self._buffer_bytes = 0
        frames = self._rep.recv_multipart(copy=False)
        if len(frames) != 3 or len(frames[2].bytes) != 8:
            self.num_bad_requests += 1
            return
        peer = _peer(frames[-1])
        ident = frames[0].bytes
        start = int.from_bytes(frames[2].bytes, "big")
        reply: list[tuple[int, bytes]] = []
        if self._buffer and start >= self._buffer[0][0]:
            if self._replay_peers.take(peer):
                reply = [(s, p) for s, p in self._buffer if s >= start]
                self.num_replays += 1
            else:
                self.num_refused += 1
        elif start <= self._seq:  # older than the buffer: the whole state, tagged as of now
            if time.monotonic() >= self._next_whole and self._peers.take(peer) and self._overall.take(""):
                pending = self._take_pending()  # sent first: their numbers come before the reply's
                if pending:
                    self._send(self._events(pending))
                reply = [(self._seq, encode_batch(g)) for g in cut(self._whole_state())]
                self._paid(sum(len(p) for _, p in reply))
                self.num_snapshots += 1
            else:
                self.num_refused += 1
        self._reply(ident, reply)

    def _reply(self, ident: bytes, batches: list[tuple[int, bytes]]) -> None:
        import zmq

        try:
            for seq, payload in batches:
                self._rep.send_multipart([ident, b"", self.config.topic, seq.to_bytes(8, "big"), payload],
                                         flags=zmq.NOBLOCK)
            self._rep.send_multipart([ident, b"", b"", END_SEQ, b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the requester went away, or is not reading: it asks again

    def _take_pending(self) -> list[tuple[str, bool | None, list[Any]]]:
        with self._lock:
            pending, self._pending, self._num_pending = self._pending, [], 0
        return pending

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._rep, zmq.POLLIN)
        last = last_welcome = 0.0
        try:
            while not self._closed.is_set():
                try:
                    ready = dict(poller.poll(int(_FLUSH_S * 1000)))
                    if self._poll is not None:
                        self._poll()  # what the tiers did since, also in the background
                    if ready.get(self._pub) and self._pub.recv()[:1] == b"\x01":  # a reader subscribed
                        self._welcome_due = self._heard = True
                    if ready.get(self._rep):
                        self._answer_replay()
                    now = time.monotonic()
                    if self._welcome_due and now - last_welcome >= WELCOME_INTERVAL_S and now >= self._next_whole:
                        self._welcome_due, last_welcome, last = False, now, now
                        pending = self._take_pending()  # first: their order with the clear matters
                        self._paid(self._send(self._events(pending) + self._whole_state()))
                        self.num_welcomes += 1
                        continue
                    pending = self._take_pending()
                    if pending or now - last >= HEARTBEAT_S:
                        self._send(self._events(pending))
                        last = now
                except Exception as exc:  # a publisher fault never reaches the store
                    logger.warning("kvstrata: KV events: %s: %s", type(exc).__name__, exc)
                    time.sleep(_FLUSH_S)
            pending = self._take_pending()
            if pending:
                self._send(self._events(pending))
        finally:
            self._shutdown_sockets(linger=200)

    def _shutdown_sockets(self, linger: int = 0) -> None:
        self._pub.close(linger=linger)
        self._rep.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def close(self) -> None:
        """Send what is queued, stop the thread and unbind. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if os.getpid() == self._pid:
            self._thread.join(timeout=5)


def parents_first(items: list[tuple[BlockKey, str]]) -> list[tuple[BlockKey, str]]:
    """`items` reordered so that a block whose parent is among them comes after it (a stable
    topological order; blocks of unrelated chains keep their relative order)."""
    by_hash: dict[bytes, list[int]] = {}
    for i, (key, _) in enumerate(items):
        by_hash.setdefault(bytes(key.block_hash), []).append(i)
    done = [False] * len(items)
    out: list[tuple[BlockKey, str]] = []
    for i in range(len(items)):
        chain = []
        j: int | None = i
        while j is not None and not done[j]:
            done[j] = True
            chain.append(j)
            parent = items[j][0].parent
            j = next((p for p in by_hash.get(bytes(parent or b""), ()) if not done[p]), None)
        out.extend(items[k] for k in reversed(chain))
    return out


def _peer(frame: Any) -> str:
    """Who sent a message: its CURVE public key where authenticated, else its address."""
    import zmq

    for prop in ("User-Id", "Peer-Address"):
        try:
            value = frame.get(prop)
        except zmq.ZMQError:
            continue
        if value:
            return str(value)
    return "?"

