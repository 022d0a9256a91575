"""A loopback TCP proxy the benches put between a client and its server: it accepts on a
loopback port, opens one connection to `target_port` per client, and pumps bytes both ways
on two threads per connection. Subclasses shape the link in `_forward` (`soak_proxy.py`:
slow or dropped links; `slow_link.py`: a capped rate)."""

from __future__ import annotations

import contextlib
import socket
import threading


class LoopbackProxy:
    """Listens on a loopback port (`port`) and forwards each connection to `target_port`
    (`connect_timeout_s` to reach it; a client whose server is down is closed)."""

    CHUNK = 1 << 16

    def __init__(self, target_port: int, *, connect_timeout_s: float, nodelay: bool = False) -> None:
        self.target_port = target_port
        self._connect_timeout_s = connect_timeout_s
        self._nodelay = nodelay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.bytes_forwarded = [0, 0]  # to the server, to the clients
        threading.Thread(target=self._accept, daemon=True).start()

    def drop(self) -> None:
        """Close every open connection at once (clients see a reset mid-reply)."""
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self) -> None:
        """Stop accepting, and close every open connection."""
        self._closed = True
        self._listener.close()
        self.drop()

    def __enter__(self) -> LoopbackProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forward(self, way: int, nbytes: int) -> None:
        """Called before each chunk of `nbytes` goes on (way 0: to the server, 1: to the
        client); may wait. Forwards at once by default."""

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=self._connect_timeout_s)
                server.settimeout(None)
            except OSError:
                client.close()  # the server is down: so is the link
                continue
            if self._nodelay:
                for s in (client, server):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, server))
            for way, (a, b) in enumerate(((client, server), (server, client))):
                threading.Thread(target=self._pump, args=(a, b, way), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: int) -> None:
        buf = memoryview(bytearray(self.CHUNK))
        try:
            while n := src.recv_into(buf):
                self._forward(way, n)
                dst.sendall(buf[:n])
                self.bytes_forwarded[way] += n
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._conns.difference_update((src, dst))
