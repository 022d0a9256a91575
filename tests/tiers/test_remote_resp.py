"""The remote tier's own RESP code (`tiers/remote/resp.py`): replies parsed from real sockets however
the bytes are split, values received into the caller's buffer, and commands packed so a real
`redis-server` reads them back bit-exact, in RESP2 and RESP3.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from cli.redis_servers import redis_server
from tiers.remote.resp import Oversized, ProtocolError, ReplyError, RespReader, command, send_all


def _drip(sock: socket.socket, data: bytes, piece: int) -> threading.Thread:
    """Send `data` in pieces of `piece` bytes from a thread (each piece its own send)."""
    def run() -> None:
        for i in range(0, len(data), piece):
            sock.sendall(data[i : i + piece])
            if i % (piece * 64) == 0:
                time.sleep(0.001)  # let the reader see a partial reply

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("piece", [1, 7, 1 << 16])
def test_replies_of_every_kind_however_split(pair: tuple[socket.socket, socket.socket], piece: int) -> None:
    a, b = pair
    value = np.random.default_rng(0).bytes(100_000)
    stream = (b"+OK\r\n-OOM command not allowed\r\n:42\r\n$-1\r\n_\r\n#t\r\n,1.5\r\n"
              b">3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$2\r\nhi\r\n"  # a RESP3 push before the next reply
              b"*2\r\n$1\r\na\r\n:7\r\n%1\r\n+k\r\n+v\r\n"
              + f"${len(value)}\r\n".encode() + value + b"\r\n"
              b"$5\r\nhello\r\n$3\r\nbig\r\n:1\r\n")
    thread = _drip(b, stream, piece)
    reader = RespReader(a)
    assert reader.reply() == b"OK"
    err = reader.reply()
    assert isinstance(err, ReplyError) and str(err) == "OOM command not allowed" and not err.is_redirect
    assert [reader.reply() for _ in range(5)] == [42, None, None, True, 1.5]
    assert reader.reply() == [b"a", 7]  # the push message was skipped
    assert reader.reply() == [b"k", b"v"]
    buf = bytearray(len(value))
    got = reader.bulk_into(lambda n: memoryview(buf)[:n], len(value))
    assert isinstance(got, memoryview) and bytes(got) == value
    assert reader.bulk_into(lambda n: None, 1 << 20) == Oversized(5)  # read and dropped: the stream stays in step
    assert bytes(reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)) == b"big"  # type: ignore[arg-type]
    assert reader.reply() == 1 and reader.idle
    thread.join(5)


def test_null_error_and_push_before_a_bulk_reply(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(b"$-1\r\n_\r\n-MOVED 3999 127.0.0.1:6381\r\n>2\r\n$4\r\npush\r\n:1\r\n$2\r\nok\r\n")
    reader = RespReader(a)
    assert reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20) is None
    assert reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20) is None
    moved = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)
    assert isinstance(moved, ReplyError) and moved.is_redirect
    assert bytes(reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)) == b"ok"  # type: ignore[arg-type]


@pytest.mark.parametrize("garbage", [b"?what\r\n", b"$abc\r\n", b"$3\r\nabcXY", b":1\r\n"])
def test_anything_but_the_reply_expected_is_a_protocol_error(pair: tuple[socket.socket, socket.socket],
                                                            garbage: bytes) -> None:
    a, b = pair
    b.sendall(garbage)
    with pytest.raises(ProtocolError):
        RespReader(a).bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)


def test_a_closed_connection_mid_value_is_an_error_not_a_hang(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(b"$100\r\nonly part")
    b.close()
    with pytest.raises(ConnectionError):
        RespReader(a).bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)


def test_a_reply_line_longer_than_the_buffer_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(b"+" + b"x" * 70_000 + b"\r\n")
    with pytest.raises(ProtocolError, match="longer than"):
        RespReader(a).reply()


def test_commands_reference_large_values_and_pack_small_ones() -> None:
    big = bytearray(np.random.default_rng(1).bytes(5000))
    parts = command(b"SET", b"k", memoryview(big), b"EX", 60)
    assert any(p is not big and isinstance(p, memoryview) and p.obj is big for p in parts)  # not copied
    assert b"".join(bytes(p) for p in parts) == (b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$5000\r\n" + bytes(big)
                                                  + b"\r\n$2\r\nEX\r\n$2\r\n60\r\n")


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_real_server_reads_what_send_all_packs(protocol: int) -> None:
    """Hundreds of commands (values small and large, one gathered send each) reach a real
    redis-server intact and its replies parse, in either protocol version."""
    values = [np.random.default_rng(i).bytes(size) for i, size in enumerate([0, 1, 4095, 4096, 70_000, 1 << 20])]
    with redis_server() as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        reader = RespReader(sock)
        send_all(sock, command("HELLO", protocol))
        assert isinstance(reader.reply(4096), list)
        buffers = [p for i, v in enumerate(values) for p in command(b"SET", b"key:%d" % i, v)]
        buffers += [p for i in range(len(values)) for p in command(b"GET", b"key:%d" % i)]
        buffers += command(b"GET", b"absent") + command(b"INCR", b"key:5")
        send_all(sock, buffers * 20)
        for _ in range(20):
            assert [reader.reply() for _ in values] == [b"OK"] * len(values)
            for v in values:
                got = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)
                assert isinstance(got, memoryview) and bytes(got) == v
            assert reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20) is None
            err = reader.reply()
            assert isinstance(err, ReplyError) and "not an integer" in str(err)
        assert reader.idle
