"""A TCP proxy between the soak's engines and its server that can turn slow or drop every
connection on demand: the slow and broken links of a real network, on loopback."""

from __future__ import annotations

import time

from bench.tcp_proxy import LoopbackProxy


class FaultyLink(LoopbackProxy):
    """Listens on a loopback port and forwards each connection to `target_port`.

    `slow(seconds, delay_s)` delays every forwarded chunk by `delay_s` for `seconds`;
    `drop()` closes every open connection at once (clients see a reset mid-reply).
    """

    def __init__(self, target_port: int) -> None:
        self._slow_until = 0.0
        self._delay_s = 0.0
        super().__init__(target_port, connect_timeout_s=2)

    def slow(self, seconds: float, delay_s: float) -> None:
        self._delay_s, self._slow_until = delay_s, time.monotonic() + seconds

    def _forward(self, way: int, nbytes: int) -> None:
        if time.monotonic() < self._slow_until:
            time.sleep(self._delay_s)
