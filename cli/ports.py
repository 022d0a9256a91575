"""Free loopback ports for the demos, benchmarks and tests that bind real sockets."""

from __future__ import annotations

import random
import socket


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free loopback port below 55000 (a cluster node also needs port + 10000)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port < 55000:
            return port
    raise RuntimeError("no free port below 55000")


def free_port_pair() -> int:
    """A port P with P and P + 1 free on loopback, below 55000 (KV events bind both)."""
    for _ in range(200):
        port = random.randrange(20000, 54000, 2)
        if _free(port) and _free(port + 1):
            return port
    raise RuntimeError("no free pair of loopback ports")
