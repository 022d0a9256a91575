"""A TCP proxy on loopback that caps the bytes per second it forwards: a network link slower
than the host, between a tier and its server.

Each direction has one pacer shared by every connection (the link's capacity, not each
connection's): a chunk is forwarded once the link has had time to carry the bytes before it,
with at most `burst_s` of unused capacity saved up. Loopback itself is far faster, so the
cap is the link's rate as long as the proxy's own copying keeps up (the bench reports the
rate it measured, with the cap).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 256 << 10


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


class SlowLink:
    """Listens on a loopback port (`port`, `url`) and forwards each connection to
    `target_port`, at most `rate` bytes per second each way (None: no cap)."""

    def __init__(self, target_port: int, rate: float | None, *, burst_s: float = 0.002) -> None:
        self.target_port = target_port
        self._pacers = (None, None) if rate is None else (_Pacer(rate, burst_s), _Pacer(rate, burst_s))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.bytes_forwarded = [0, 0]  # to the server, to the clients
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, server))
            for way, (a, b) in enumerate(((client, server), (server, client))):
                threading.Thread(target=self._pump, args=(a, b, way), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: int) -> None:
        pacer = self._pacers[way]
        buf = memoryview(bytearray(CHUNK))
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                if pacer is not None:
                    pacer.take(n)
                dst.sendall(buf[:n])
                self.bytes_forwarded[way] += n
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
