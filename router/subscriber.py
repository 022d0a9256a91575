"""The router's ZeroMQ side: one SUB socket per source, and at most one replay (a DEALER
socket, vLLM's replay protocol) per source at a time. Every socket caps inbound messages
(`zmq.MAXMSGSIZE`); with CURVE keys each source is authenticated by its public key. A
message that does not decode is counted and logged (rate-limited), never the end of a
subscription. Each message is paid for from its source's budget of bytes before it is
decoded (`FleetView.admit`), and each yields the loop, so one source's flood cannot starve
the others or the lookups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvevents import END_SEQ, MAX_MESSAGE_BYTES, CurveClient
from router.decode import BadMessage, Event, decode_batch
from router.fleet import FleetView
from router.source import Source

logger = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 5.0
MAX_REPLAY_BATCHES = 100_000
_LOG_EVERY_S = 10.0


class Subscriber:
    """Follows the sources of a `FleetView` on one asyncio loop."""

    def __init__(self, fleet: FleetView, curve: CurveClient | None = None,
                 curve_server_key: bytes | None = None) -> None:
        import zmq.asyncio

        self.fleet, self.curve, self.curve_server_key = fleet, curve, curve_server_key
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._replays: set[asyncio.Task[None]] = set()
        self._last_log = 0.0

    def _socket(self, kind: int, src: Source) -> Any:
        import zmq

        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        key = src.curve_server_key or self.curve_server_key
        if key is not None and self.curve is not None:
            self.curve.secure(sock, key)
        return sock

    def follow(self, src: Source) -> None:
        """Start following `src` (again: a running subscription is replaced)."""
        self.drop(src.endpoint)
        self._tasks[src.endpoint] = asyncio.ensure_future(self._listen(src))

    def drop(self, endpoint: str) -> None:
        task = self._tasks.pop(endpoint, None)
        if task is not None:
            task.cancel()

    def _bad(self, src: Source, what: str) -> None:
        src.num_bad += 1
        self.fleet.num_bad_messages += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            logger.warning("kvstrata router: dropped a malformed message from %s: %s (%d so far from it)",
                           src.endpoint, what, src.num_bad)

    def _decode(self, src: Source, payload: bytes) -> list[Event] | None:
        try:
            events, bad = decode_batch(payload)
        except BadMessage as exc:
            self._bad(src, str(exc))
            return None
        if bad:
            self.fleet.num_bad_events += bad
            self._bad(src, f"{bad} malformed events")
        return events

    async def _listen(self, src: Source) -> None:
        import zmq

        sock = self._socket(zmq.SUB, src)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(src.endpoint)
        if self.fleet.start_replay(src, time.monotonic()):
            self._replay(src, 0)  # what happened before the router subscribed
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    self._take(src, frames)
                except Exception as exc:  # a fault of the router's own: counted, never the end of a subscription
                    self._bad(src, f"{type(exc).__name__} applying it")
                await asyncio.sleep(0)  # a message already queued does not yield: other sources and lookups go on
        finally:
            sock.close(linger=0)

    def _take(self, src: Source, frames: list[bytes]) -> None:
        """Decode and apply one live message (a replay is requested where the fleet asks)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(src, f"{len(frames)} frames")
            return
        if not self.fleet.admit(src, len(frames[2]), time.monotonic()):
            return  # over its budget: dropped undecoded (counted); the next batch taken shows the gap
        events = self._decode(src, frames[2])
        if events is None:
            return
        start = self.fleet.on_live(src, int.from_bytes(frames[1], "big"), events, time.monotonic())
        if start is not None:
            self._replay(src, start)

    def _replay(self, src: Source, start: int) -> None:
        task = asyncio.ensure_future(self._fetch(src, start))
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def _fetch(self, src: Source, start: int) -> None:
        """Request a replay from batch `start`; hand what came to the fleet (nothing on a
        fault: the live stream carries on from where it is)."""
        import zmq

        assert src.replay_endpoint is not None
        sock = self._socket(zmq.DEALER, src)
        sock.connect(src.replay_endpoint)
        batches: list[tuple[int, list[Event]]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while len(batches) < MAX_REPLAY_BATCHES:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    raise TimeoutError("no end of replay")
                frames = await sock.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) == 3 and body[1] == END_SEQ:
                    break
                if len(body) != 3 or len(body[1]) != 8:
                    self._bad(src, f"a replay reply of {len(frames)} frames")
                    continue
                if not self.fleet.admit(src, len(body[2]), time.monotonic()):
                    break  # over its budget: what came is applied, the rest is a gap
                events = self._decode(src, body[2])
                if events is not None:
                    batches.append((int.from_bytes(body[1], "big"), events))
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.info("kvstrata router: replay from %s failed: %s", src.replay_endpoint, exc or type(exc).__name__)
        finally:
            sock.close(linger=0)
            if src.endpoint in self.fleet.sources:
                self.fleet.on_replay(src, start, batches)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._replays]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.term()
