"""Replies that claim more than their command can return (`tiers/remote/resp.py`, the per-call bound
of `tiers/remote/client.py`): a loopback server answering `$1073741824` to EXISTS, SET or GET,
or flooding an INFO reply, costs the tier a counted fault and a miss, before its deadline,
never the memory the claim names. The tier runs against a real socket (`tests/drip_server.py`
answers everything else like Redis).
"""

from __future__ import annotations

import socket
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.drip_server import DripServer, on_generation
from tests.reliability.kvgen import BLOCK, LAYOUT
from tiers.keys import BlockHash, BlockKey
from tiers.remote.resp import ReplyTooLong, RespReader
from tiers.remote.tier import RemoteTier

GIB_CLAIM = b"$1073741824\r\n"
TIMEOUT_S = 5.0  # the tier's deadline: a call that waited for the claimed bytes would take it all
PEAK_BYTES = 16 << 20


class HostileServer(DripServer):
    """Answers the commands in `answers` with their bytes (but those on the generation), then,
    for those in `flood`, sends up to `flood_bytes` more (in 64 KiB pieces of one buffer) and
    keeps the connection open."""

    def __init__(self, answers: dict[str, bytes], flood: set[str] | None = None, flood_bytes: int = 64 << 20) -> None:
        self.answers, self.flood, self.flood_bytes = answers, flood or set(), flood_bytes
        super().__init__(set())

    def _answer(self, conn: socket.socket, name: str, command: list[bytes]) -> bool:
        hostile = None if on_generation(command) else self.answers.get(name)
        conn.sendall(hostile or self._reply(command))
        piece = b"x" * (1 << 16)
        for _ in range(self.flood_bytes // len(piece) if name in self.flood else 0):
            conn.sendall(piece)
        return True


def _tier(url: str) -> RemoteTier:
    return RemoteTier(url, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=b"hostile", timeout_s=TIMEOUT_S)


def _measured(call: Callable[[], Any]) -> tuple[Any, float, int]:
    """`call()`'s result, its seconds and the peak of Python memory allocated during it."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        result = call()
        return result, time.monotonic() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def key() -> BlockKey:
    return BlockKey(BlockHash(b"\x07" * 16), b"")


@pytest.mark.parametrize("command", ["EXISTS", "GET", "SET"])
def test_a_claimed_gigabyte_is_a_counted_miss_not_an_allocation(command: str, key: BlockKey) -> None:
    """One line, `$1073741824`, in reply to a lookup, a read or a write (nothing follows it):
    the call ends at once with a counted fault, the connection closed; nothing near the
    claim is allocated. A value claimed that long under a block's key counts as damaged."""
    with HostileServer({command: GIB_CLAIM}) as server:
        tier = _tier(server.url)
        try:
            x = torch.zeros(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            if command == "EXISTS":
                got, took, peak = _measured(lambda: tier.match_prefix([key.block_hash]))
                health = tier.reads
            elif command == "GET":
                got, took, peak = _measured(lambda: tier.get_into([key], [x]))
                health = tier.reads
                assert tier.stats().num_corrupt == 1 and "DEL" in server.commands
            else:
                got, took, peak = _measured(lambda: tier.put([key], [x]) and tier.flush() and 0)
                health = tier.writes
                assert tier.num_write_drops == 1
            assert got == 0 and health.num_errors == 1  # no hit (a write: flushed, then dropped)
            assert peak < PEAK_BYTES, f"{peak >> 20} MiB allocated for a claimed reply"
            assert took < TIMEOUT_S - 1, f"the call waited {took:.1f} s for bytes claimed, not sent"
            ends = time.monotonic() + 10
            while server.num_closed < 1:  # the connection out of step was dropped
                assert time.monotonic() < ends, "the connection was kept"
                time.sleep(0.01)
        finally:
            tier.close()


def test_a_flooded_info_reply_is_cut_at_the_calls_bound() -> None:
    """INFO (read by redis-py, which buffers whatever a reply claims as it arrives) answered
    with a 1 GiB claim and 64 MiB of bytes at once: the call fails at its bound of about a
    MiB or two, a counted fault, not after buffering the flood."""
    with HostileServer({"INFO": GIB_CLAIM}, flood={"INFO"}) as server:
        tier = _tier(server.url)
        try:
            occ, _, peak = _measured(tier.occupancy)
            assert occ.used_bytes == 0 and tier.reads.num_errors == 1
            assert peak < PEAK_BYTES, f"{peak >> 20} MiB buffered of a flooded reply"
        finally:
            tier.close()




@pytest.mark.parametrize("reply", [GIB_CLAIM, b"*1000000000\r\n", b"%600000000\r\n", b"!1073741824\r\n",
                                   b"*1\r\n" * 20 + b":1\r\n", b"*2\r\n$40\r\n" + b"y" * 40 + b"\r\n$40\r\n"])
def test_the_reader_refuses_claims_past_the_limit_before_reading_them(pair: tuple[socket.socket, socket.socket],
                                                                      reply: bytes) -> None:
    """Bulk lengths, aggregate counts, nesting and the sum of a reply's parts are each checked
    against the caller's limit (64 bytes here) before anything is allocated for them."""
    a, b = pair
    b.sendall(reply)
    tracemalloc.start()
    try:
        with pytest.raises(ReplyTooLong):
            RespReader(a).reply(64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_the_reader_takes_replies_up_to_the_limit(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    value = b"z" * 1000
    b.sendall(b"$1000\r\n" + value + b"\r\n" + b"$1001\r\n")
    reader = RespReader(a)
    assert reader.reply(1000 + 9) == value  # "$1000\r\n" and the CRLF after it count too
    got = bytearray(2000)
    with pytest.raises(ReplyTooLong):
        reader.bulk_into(lambda n: memoryview(got)[:n], 1000)
