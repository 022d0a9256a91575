"""A TCP proxy between the soak's engines and its server that can turn slow or drop every
connection on demand: the slow and broken links of a real network, on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FaultyLink:
    """Listens on a loopback port and forwards each connection to `target_port`.

    `slow(seconds, delay_s)` delays every forwarded chunk by `delay_s` for `seconds`;
    `drop()` closes every open connection at once (clients see a reset mid-reply).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._slow_until = 0.0
        self._delay_s = 0.0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def slow(self, seconds: float, delay_s: float) -> None:
        self._delay_s, self._slow_until = delay_s, time.monotonic() + seconds

    def drop(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
                server.settimeout(None)
            except OSError:
                client.close()  # the server is down: so is the link
                continue
            with self._lock:
                self._conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if time.monotonic() < self._slow_until:
                    time.sleep(self._delay_s)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._conns.difference_update((src, dst))
