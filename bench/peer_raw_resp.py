"""The floor under the remote rows of `kvstrata bench peer`: the same values through a minimal RESP client.

Bare values (no record, header or checksum), each block's KV made contiguous untimed (as
LMCache's memory objects are), SET and then GET pipelined `DEPTH` deep on one connection:
each SET gathered by `sendmsg` from the value's own memory, every GET's reply received into
one buffer with no parsing (all replies have one known length), the replies checked after
the clock stops. What is left in the time is the server's and the kernel's work for these
bytes and as little Python per value as a client can have: the rate no client of this
server on this host beats by much, checks or not.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from tiers.remote.resp import send_all

DEPTH = 4  # requests in flight (a minimal client's SETs of 256 KiB ran fastest at 2-8 here)


def _address(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("redis://").partition(":")
    return host, int(port)


def _pipelined(sock: socket.socket, requests: list[list[Any]], reply_bytes: int, into: memoryview) -> None:
    """Send `requests` (each a list of buffers, gathered) at most `DEPTH` unanswered, and
    receive their replies, `reply_bytes` each, into `into`."""
    sent = received = 0
    total = len(requests) * reply_bytes
    while received < total:
        while sent < len(requests) and sent - received // reply_bytes < DEPTH:
            send_all(sock, requests[sent])  # gathered by sendmsg, whole
            sent += 1
        n = sock.recv_into(into[received:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        received += n


def raw_side(spec: dict[str, Any]) -> dict[str, Any]:
    """One size and round through the minimal client (run in a child process)."""
    import torch

    from bench.peer_lmcache import _kv

    block = spec["block_tokens"]
    values: list[memoryview] = []
    for seed in spec["seeds"]:
        kv = _kv(seed, spec["prompt_tokens"])
        values += [memoryview(kv[:, :, i : i + block].contiguous().view(-1).view(torch.uint8).numpy())
                   for i in range(0, kv.shape[2], block)]
    size = values[0].nbytes
    keys = [b"raw:%d" % i for i in range(len(values))]
    sets = [[b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size), v, b"\r\n"] for k, v in zip(keys, values)]
    gets = [[b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)] for k in keys]
    head = b"$%d\r\n" % size
    per = len(head) + size + 2
    oks = memoryview(bytearray(5 * len(keys)))
    replies = memoryview(bytearray(per * len(keys)))  # faulted in below, as the other sides' buffers are
    replies[:] = bytes(replies.nbytes)
    with socket.create_connection(_address(spec["url"])) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        _pipelined(sock, sets, 5, oks)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _pipelined(sock, gets, per, replies)
        read_s = time.perf_counter() - t0
    assert bytes(oks) == b"+OK\r\n" * len(keys), "a SET was refused"
    assert all(replies[i * per : (i + 1) * per] == head + bytes(v) + b"\r\n" for i, v in enumerate(values)), \
        "a GET returned other bytes"
    return {"bytes": size * len(values), "write_s": write_s, "read_s": read_s}
