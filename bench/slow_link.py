"""A TCP proxy on loopback that caps the bytes per second it forwards: a network link slower
than the host, between a tier and its server.

Each direction has one pacer shared by every connection (the link's capacity, not each
connection's): a chunk is forwarded once the link has had time to carry the bytes before it,
with at most `burst_s` of unused capacity saved up. Loopback itself is far faster, so the
cap is the link's rate as long as the proxy's own copying keeps up (the bench reports the
rate it measured, with the cap).
"""

from __future__ import annotations

import threading
import time

from bench.tcp_proxy import LoopbackProxy


class _Pacer:
    """Lets bytes through at `rate` bytes per second, on average, across threads."""

    def __init__(self, rate: float, burst_s: float) -> None:
        self.rate, self.burst_s = rate, burst_s
        self._lock = threading.Lock()
        self._free_at = time.monotonic()  # when the link has carried everything let through so far

    def take(self, nbytes: int) -> None:
        """Wait until `nbytes` more fit through the link."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now - self.burst_s) + nbytes / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


class SlowLink(LoopbackProxy):
    """Listens on a loopback port (`port`, `url`) and forwards each connection to
    `target_port`, at most `rate` bytes per second each way (None: no cap)."""

    CHUNK = 256 << 10

    def __init__(self, target_port: int, rate: float | None, *, burst_s: float = 0.002) -> None:
        self._pacers = (None, None) if rate is None else (_Pacer(rate, burst_s), _Pacer(rate, burst_s))
        super().__init__(target_port, connect_timeout_s=5, nodelay=True)
        self.url = f"redis://127.0.0.1:{self.port}"

    def __enter__(self) -> SlowLink:
        return self

    def _forward(self, way: int, nbytes: int) -> None:
        pacer = self._pacers[way]
        if pacer is not None:
            pacer.take(nbytes)
