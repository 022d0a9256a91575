"""Large remote reads and writes over several connections per server node
(`tiers/remote/lanes.py`, `Server.stream`), against a real `redis-server`: one key's writes
and deletes keep their order across lanes; a lane whose connection is cut mid-way is a
counted miss (reads) or counted drops (writes) from its first lost block on, never a hang,
wrong bytes or a hole in what a read returns; the lanes' threads and connections stay bounded.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import redis
import torch
import xxhash

from bench.tcp_proxy import LoopbackProxy
from cli.redis_servers import redis_server
from kvstore import KVLayout
from tests.reliability.kvgen import BLOCK
from tiers.keys import BlockHash, BlockKey
from tiers.remote.client import Server
from tiers.remote.lanes import Lanes
from tiers.remote.stream import Op, command
from tiers.remote.tier import RemoteTier

LANES = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 256 KiB blocks
NUM_BLOCKS = 32  # 8 MiB a call: past `SPLIT_FROM`, so split into lanes


def _tier(url: str, **kwargs: object) -> RemoteTier:
    return RemoteTier(url, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=b"lanes-test",  # type: ignore[arg-type]
                      timeout_s=5.0, connections_per_node=LANES, **kwargs)


def _keys(n: int, seed: int) -> list[BlockKey]:
    return [BlockKey(BlockHash(xxhash.xxh3_128_digest(f"{seed}:{i}".encode()))) for i in range(n)]


def _blocks(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.block_shape(BLOCK), generator=gen).to(LAYOUT.dtype) for _ in range(n)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _lane_threads() -> int:
    return sum(t.name.startswith("kvstrata-remote-lane") for t in threading.enumerate())


def test_one_keys_writes_and_deletes_keep_their_order_over_several_connections() -> None:
    """Eight versions of the same 32 blocks queued back to back (so a batch holds several
    versions of a key), a quarter of them deleted after every other version: every block
    then reads as the last version written, or is absent where the delete came last; never
    an older version landing after a newer one or after its delete."""
    keys, rounds = _keys(NUM_BLOCKS, 1), 8
    versions = _blocks(rounds, 2)
    with redis_server() as server:
        tier = _tier(server.url)
        try:
            deleted_last: set[int] = set()
            for r in range(rounds):
                assert tier.put(keys[::-1], [versions[r]] * len(keys)) == len(keys)
                deleted_last = set()
                if r % 2:
                    deleted_last = set(range(r // 2 % 4, len(keys), 4))
                    tier.discard([keys[i].block_hash for i in sorted(deleted_last)])
            assert tier.flush() and tier.num_write_drops == 0 and tier.num_errors == 0
            assert deleted_last  # the last round's delete came after its write
            for i, key in enumerate(keys):
                out = torch.zeros_like(versions[0])
                got = tier.get_into([key], [out])
                if i in deleted_last:
                    assert got == 0, f"block {i} was deleted after its last write, yet it reads back"
                    continue
                assert got == 1, f"block {i} was written last, yet it is absent"
                old = [r for r in range(rounds) if _same(out, versions[r])]
                assert old == [rounds - 1], f"block {i} reads as version {old}, not the last ({rounds - 1})"
            assert 1 <= _lane_threads() <= LANES - 1
        finally:
            tier.close()


def test_one_calls_commands_on_a_key_keep_their_order_across_lanes() -> None:
    """One call of 16 MiB, split over 4 lanes: for each of 64 keys a SET of an old value, a
    SET of a new one and, for every third key, a DEL. Each key ends with the new value, or
    absent where its DEL came last (lanes by key: one key's commands share a connection)."""
    old, new = b"o" * (128 << 10), b"n" * (128 << 10)
    keys = [f"lanes-order:{i}".encode() for i in range(64)]
    ops = [Op(b"", command(b"PING"), 0)]
    for i, key in enumerate(keys):
        ops += [Op(key, command(b"SET", key, old), len(old)), Op(key, command(b"SET", key, new), len(new))]
        if i % 3 == 0:
            ops.append(Op(key, command(b"DEL", key), 0))
    with redis_server() as server:
        srv = Server(server.url, timeout_s=5.0, min_rate_bps=64 << 20, cooldown_s=5.0, window_bytes=1 << 20,
                     password=None, connections_per_node=LANES)
        try:
            lanes_seen: set[str] = set()
            assert srv.stream(srv.writes, "ordered writes", 2 * len(keys) * len(old), ops,
                              lambda i, reply: lanes_seen.add(threading.current_thread().name) is None, head=1)
            assert len(lanes_seen) > 1  # the call did run on several threads
            raw = redis.Redis(port=server.port)
            for i, key in enumerate(keys):
                assert raw.get(key) == (None if i % 3 == 0 else new), f"key {i} ends out of order"
        finally:
            srv.close()


class _CutAt(LoopbackProxy):
    """Forwards every connection until one sends a command naming `marker`; that connection
    then gets what it sent before the command, its replies for `hold_s`, and is closed."""

    def __init__(self, target_port: int, marker: bytes, hold_s: float = 0.5) -> None:
        super().__init__(target_port, connect_timeout_s=5.0)
        self.marker, self.hold_s = marker, hold_s
        self.cuts = 0

    def _pump(self, src: socket.socket, dst: socket.socket, way: int) -> None:
        if way == 1:
            return super()._pump(src, dst, way)
        try:
            while data := src.recv(self.CHUNK):
                at = data.find(self.marker)
                if at < 0:
                    dst.sendall(data)
                    continue
                dst.sendall(data[: data.rfind(b"*", 0, at)])  # the commands before the marked one
                self.cuts += 1
                time.sleep(self.hold_s)  # their replies go on meanwhile
                break
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def test_a_read_whose_lane_is_cut_mid_way_returns_the_blocks_before_the_cut_and_counts_a_fault() -> None:
    """32 blocks read over 4 lanes; the lane carrying block 20 loses its connection as that
    GET is sent: the read returns exactly blocks 0-19, each its own bytes, within the deadline,
    with one fault counted; the next read (the cut healed) returns all 32."""
    keys, blocks = _keys(NUM_BLOCKS, 3), _blocks(NUM_BLOCKS, 4)
    with redis_server() as server:
        writer = _tier(server.url)
        try:
            assert writer.put(keys[::-1], blocks[::-1]) == NUM_BLOCKS and writer.flush()
            marker = writer.server_key(keys[20].block_hash)
        finally:
            writer.close()
        with _CutAt(server.port, marker) as proxy:
            tier = _tier(f"redis://127.0.0.1:{proxy.port}")
            try:
                out = [torch.zeros_like(b) for b in blocks]
                started = time.monotonic()
                got = tier.get_into(keys, out)
                assert time.monotonic() - started < 10.0
                assert proxy.cuts == 1 and got == 20, f"{got} blocks read, {proxy.cuts} cuts"
                assert all(_same(o, b) for o, b in zip(out[:got], blocks[:got]))
                assert tier.reads.num_errors == 1 and tier.counters.num_corrupt == 0
                proxy.marker = b"\0never"
                out = [torch.zeros_like(b) for b in blocks]
                assert tier.get_into(keys, out) == NUM_BLOCKS
                assert all(_same(o, b) for o, b in zip(out, blocks))
            finally:
                tier.close()


@pytest.mark.parametrize("cut_at", [5, 27])
def test_a_write_whose_lane_is_cut_mid_way_counts_every_block_it_lost(cut_at: int) -> None:
    """32 blocks written over 4 lanes; the lane carrying block `cut_at` loses its connection
    as that SET is sent: nothing hangs, at least that block is a counted drop, every block
    not on the server is counted, and the blocks a read returns are a prefix of their bytes."""
    keys, blocks = _keys(NUM_BLOCKS, 5), _blocks(NUM_BLOCKS, 6)
    with redis_server() as server:
        marker = _tier(server.url).server_key(keys[cut_at].block_hash)
        with _CutAt(server.port, marker) as proxy:
            tier = _tier(f"redis://127.0.0.1:{proxy.port}")
            try:
                tier.put(keys[::-1], blocks[::-1])
                assert tier.flush(timeout_s=30.0)
                assert proxy.cuts == 1 and tier.writes.num_errors >= 1
                raw = redis.Redis(port=server.port)
                absent = [i for i, k in enumerate(keys) if not raw.exists(tier.server_key(k.block_hash))]
                assert cut_at in absent and tier.num_write_drops >= len(absent), (absent, tier.num_write_drops)
                proxy.marker = b"\0never"
                out = [torch.zeros_like(b) for b in blocks]
                got = tier.get_into(keys, out)
                assert got == min(absent)
                assert all(_same(o, b) for o, b in zip(out[:got], blocks[:got]))
            finally:
                tier.close()


def test_an_interrupt_in_the_callers_lane_returns_only_once_the_running_lanes_ended() -> None:
    """Ctrl-C (a `KeyboardInterrupt`) in the caller's lane: `run` raises it only after the lane
    a worker runs has ended (it writes into the call's buffers), and a lane no thread started
    never starts afterwards."""
    lanes = Lanes(1, "interrupt-test")
    started, release = threading.Event(), threading.Event()
    log: list[str] = []

    def worker_lane() -> str:
        started.set()
        release.wait(5)
        time.sleep(0.2)  # still writing when the caller's lane is interrupted
        log.append("worker lane ended")
        return "w"

    def callers_lane() -> str:
        assert started.wait(5)
        release.set()
        raise KeyboardInterrupt

    def never() -> str:
        log.append("a lane started after the call")
        return "n"

    try:
        with pytest.raises(KeyboardInterrupt):
            lanes.run([callers_lane, worker_lane, never])  # lane 0 is the caller's
        assert log == ["worker lane ended"]  # ended before run raised; the third never ran
        time.sleep(0.3)
        assert log == ["worker lane ended"]
    finally:
        lanes.close()
