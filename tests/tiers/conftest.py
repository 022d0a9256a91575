"""Fixtures the tier tests share."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected sockets (the first with a 10 s timeout), closed after the test."""
    a, b = socket.socketpair()
    a.settimeout(10)
    try:
        yield a, b
    finally:
        a.close()
        b.close()
