"""A remote value's payload received straight into the caller's block (`RecordCodec.landing`,
`RespReader.bulk_into`'s `tail`): the bytes land in place and are checked there, a damaged
one is a counted miss, a record laid out otherwise is read whole, and a reply read only to
be dropped never lands. Real sockets and a real `redis-server`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
import xxhash

from cli.ports import free_port
from cli.redis_servers import RedisServerError
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tests.redis_fixtures import RedisServer, need_redis, redis_server
from tiers.codecs.base import CodecKind
from tiers.remote.resp import Landed, Oversized, RespReader
from tiers.remote.tier import RemoteTier
from tiers.shared import record as record_module
from tiers.shared.record import MIN_RUN_BYTES, RecordCodec, pack_record, parse_record

# 128 KiB rows (at least MIN_RUN_BYTES): a block of 16 tokens is 4 runs of 128 KiB in a
# `[layers, 2, tokens, heads, dim]` tensor.
WIDE = KVLayout(num_layers=2, num_kv_heads=32, head_dim=128, dtype=torch.bfloat16)
BLOCK = 16


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def _kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(WIDE.block_shape(num_tokens), generator=g).to(WIDE.dtype)


def _tokens(num_blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, num_blocks * BLOCK).astype(np.uint32)


def _store(url: str, **tier: object) -> KVCacheStore:
    """A store of the remote tier alone, one connection (no lanes: replies in one order)."""
    remote = {"type": "remote", "url": url, "connections_per_node": 1, **tier}
    return KVCacheStore(StoreConfig(WIDE, block_size=BLOCK, tiers=[remote], namespace="landing",
                                    load_policy="always"))


def _remote(store: KVCacheStore) -> RemoteTier:
    tier = store.tiers[-1]
    assert isinstance(tier, RemoteTier)
    return tier


class _Calls:
    """Counts a tier's record-check calls (the real ones run)."""

    def __init__(self, tier: RemoteTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts = {"take": 0, "take_landed": 0, "copy_out": 0}
        checks = tier._checks
        for name in self.counts:
            real = getattr(checks, name)

            def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
                self.counts[_name] += 1
                return _real(*args)

            monkeypatch.setattr(checks, name, counted)


# -- where a block's bytes may land ------------------------------------------------------------
def test_landing_views_are_a_blocks_runs_in_the_payloads_order() -> None:
    codec = RecordCodec(WIDE.block_shape(BLOCK), WIDE.dtype, verify_tokens=True, namespace=b"n")
    whole = torch.zeros(WIDE.block_shape(BLOCK), dtype=WIDE.dtype)
    runs = codec.landing(whole)
    assert runs is not None and len(runs) == 1 and runs[0].nbytes == WIDE.block_bytes(BLOCK)
    out = torch.zeros(WIDE.block_shape(4 * BLOCK), dtype=WIDE.dtype)
    rows = out[:, :, BLOCK : 2 * BLOCK]
    runs = codec.landing(rows)
    assert runs is not None and len(runs) == 2 * WIDE.num_layers and all(r.nbytes >= MIN_RUN_BYTES for r in runs)
    payload = _kv(BLOCK, seed=5).view(torch.uint8).numpy().tobytes()  # a record's payload: the block, contiguous
    at = 0
    for run in runs:
        run[:] = payload[at : at + run.nbytes]
        at += run.nbytes
    assert at == len(payload) and torch.equal(rows, _kv(BLOCK, seed=5))
    assert not out[:, :, :BLOCK].any() and not out[:, :, 2 * BLOCK :].any()  # the other rows untouched


@pytest.mark.parametrize("case", ["dtype", "shape", "short runs", "overlapping"])
def test_a_block_its_payload_cannot_land_in_has_no_landing(case: str) -> None:
    codec = RecordCodec(WIDE.block_shape(BLOCK), WIDE.dtype, verify_tokens=True, namespace=b"n")
    dst = {
        "dtype": lambda: torch.zeros(WIDE.block_shape(BLOCK), dtype=torch.float16),
        "shape": lambda: torch.zeros(WIDE.block_shape(2 * BLOCK), dtype=WIDE.dtype),
        "short runs": lambda: torch.zeros((WIDE.num_layers, 2, WIDE.num_kv_heads, 4 * BLOCK, WIDE.head_dim),
                                          dtype=WIDE.dtype).transpose(2, 3)[:, :, :BLOCK],  # 256-byte runs
        "overlapping": lambda: torch.zeros((1, *WIDE.block_shape(BLOCK)[1:]), dtype=WIDE.dtype)
        .expand(WIDE.block_shape(BLOCK)),
    }[case]()
    assert codec.landing(dst) is None


def test_the_rows_of_a_2_mib_block_land_and_those_of_a_256_kib_block_do_not() -> None:
    """The Llama-3-8B layout in a `[layers, 2, tokens, heads, dim]` tensor: 16 tokens a block
    are 64 runs of 32 KiB (they land: `scripts/remote_landing_ab.py` measured 1.07-1.19x the
    copy), 2 tokens are runs of 4 KiB (received whole and copied: landing them read 0.6x)."""
    llama = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    out = torch.zeros(llama.block_shape(64), dtype=llama.dtype)
    wide = RecordCodec(llama.block_shape(16), llama.dtype, verify_tokens=True, namespace=b"n").landing(out[:, :, 16:32])
    assert wide is not None and [r.nbytes for r in wide] == [32 << 10] * 64 and MIN_RUN_BYTES <= 32 << 10
    narrow = RecordCodec(llama.block_shape(2), llama.dtype, verify_tokens=True, namespace=b"n")
    assert narrow.landing(out[:, :, 2:4]) is None
    assert narrow.landing(torch.zeros(llama.block_shape(2), dtype=llama.dtype)) is not None  # contiguous: lands


# -- the RESP reader ---------------------------------------------------------------------------
class _OneBufferAtATime:
    """A socket as a TLS one is seen: no `recvmsg_into` (each view received on its own)."""

    gathers = False

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        return self._sock.recv_into(buffer, nbytes)


@pytest.mark.parametrize("scatter", [True, False])
def test_a_bulk_value_longer_than_its_tail_is_split_and_a_shorter_one_is_not(
        pair: tuple[socket.socket, socket.socket], scatter: bool) -> None:
    a, b = pair
    value = np.random.default_rng(2).bytes(3 * 40_000 + 100)
    stream = b"$%d\r\n%s\r\n$5\r\nshort\r\n$%d\r\n%s\r\n:1\r\n" % (len(value), value, len(value), value)
    sender = threading.Thread(target=b.sendall, args=(stream,), daemon=True)  # more than a socket buffer holds
    sender.start()
    reader = RespReader(a if scatter else _OneBufferAtATime(a))  # type: ignore[arg-type]
    target = bytearray(3 * 40_000)
    tail = [memoryview(target)[i : i + 40_000] for i in range(0, len(target), 40_000)][::-1]  # any order of views
    got = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20, tail)
    assert isinstance(got, Landed) and bytes(got.head) == value[:100]
    assert b"".join(bytes(v) for v in tail) == value[100:]
    target[:] = bytes(len(target))
    short = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20, tail)
    assert isinstance(short, memoryview) and bytes(short) == b"short" and not any(target)  # tail untouched
    assert reader.bulk_into(lambda n: None, 1 << 20, tail) == Oversized(len(value))  # dropped, tail untouched
    assert not any(target) and reader.reply() == 1 and reader.idle
    sender.join(5)


def test_values_split_over_many_views_arrive_whole_however_the_stream_is_cut(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Tails of up to 20 views (empty ones, one-byte ones, more than one `recvmsg_into`
    takes), values longer and shorter than the tail, sent in pieces of 1 byte to 200 KB
    so the reader's own buffer holds none, part, all or more than a value: each value
    arrives whole and in order, scattering or not, and the next reply is intact."""
    rng = random.Random(11)
    a, b = pair
    for _ in range(60):
        sizes = [rng.choice([0, 1, 5, 100, 4000, 70_000]) for _ in range(rng.randint(0, 20))]
        tail_bytes = sum(sizes)
        values = [rng.randbytes(tail_bytes + rng.choice([1, 30, 9000, 70_000]) if rng.random() < 0.8
                                else rng.randint(0, tail_bytes)) for _ in range(3)]
        stream = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in values) + b":7\r\n"
        cuts = [0]
        while cuts[-1] < len(stream):
            cuts.append(cuts[-1] + rng.choice([1, 3, 100, 5000, 65_536, 200_000]))
        pieces = [stream[i:j] for i, j in itertools.pairwise(cuts)]
        sender = threading.Thread(target=lambda chunks=pieces: [b.sendall(c) for c in chunks], daemon=True)
        sender.start()
        reader = RespReader(a if rng.random() < 0.7 else _OneBufferAtATime(a))  # type: ignore[arg-type]
        for value in values:
            target = bytearray(tail_bytes)
            ends = list(itertools.accumulate(sizes, initial=0))
            got = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 22,
                                   [memoryview(target)[i:j] for i, j in itertools.pairwise(ends)])
            if len(value) > tail_bytes:
                assert isinstance(got, Landed) and bytes(got.head) + target == value
            else:
                assert isinstance(got, memoryview) and bytes(got) == value and not any(target)
        assert reader.reply() == 7 and reader.idle
        sender.join(5)


class _Capped:
    """A real socket that hands over at most `caps(k)` bytes in its k-th system call (the
    kernel's order kept: `recvmsg_into` fills the views given in turn), counting calls and bytes."""

    def __init__(self, sock: socket.socket, caps: Callable[[int], int], gathers: bool = True) -> None:
        self._sock, self._caps, self.gathers = sock, caps, gathers
        self.calls = self.received = 0

    def _counted(self, n: int) -> int:
        self.calls, self.received = self.calls + 1, self.received + n
        return n

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        return self._counted(self._sock.recv_into(memoryview(buffer).cast("B")[: self._caps(self.calls)]))

    def recvmsg_into(self, buffers: Any) -> tuple[int, list[Any], int, Any]:
        assert self.gathers, "a socket that cannot gather was asked to"
        cut, left = [], self._caps(self.calls)
        for buf in buffers:
            if left:
                cut.append(buf[:left])
                left -= cut[-1].nbytes
        got = self._sock.recvmsg_into(cut)
        self._counted(got[0])
        return got


def _boundaries() -> Iterator[tuple[list[int], int]]:
    """Tails of 1 to 12 views (more than one `recvmsg_into` takes) under every cap that cuts
    them anywhere; tails of 29 KB under caps that leave the value's end, its CRLF and up to
    4 KiB and more of what follows for one receive."""
    for sizes in ([1], [3, 1, 5], [2] * 9, [1, 7, 2, 1, 3, 1, 1, 4, 2, 6, 1, 5]):
        for cap in range(1, 91):
            yield sizes, cap
    for cap in (7000, 15_000, 20_000, 26_000, 40_000):
        yield [20_000, 3, 9000], cap


@pytest.mark.parametrize("gathers", [True, False])
def test_a_values_last_receive_takes_no_more_than_what_follows_it_whatever_a_call_brings(
        pair: tuple[socket.socket, socket.socket], gathers: bool) -> None:
    """So that a value's head and tail are held in part, in whole or not at all on entry, and
    its last receive fills its views exactly, stops short of them, or spills 1 byte to all 4
    KiB of the spare (the CRLF and the next replies) into the reader's buffer: each value
    arrives whole, the replies after it intact, the stream's every byte received once (what
    `_charge` counts) and none asked for past it (a 2 s timeout)."""
    a, b = pair
    a.settimeout(2)
    rng = random.Random(3)
    for sizes, cap in _boundaries():
        value = rng.randbytes(sum(sizes) + rng.choice([1, 2, 40]))
        after = rng.randbytes(rng.choice([0, 3, 6000]))  # the next value: none, short, or longer than 4 KiB
        stream = b"$%d\r\n%s\r\n$%d\r\n%s\r\n:7\r\n" % (len(value), value, len(after), after)
        b.sendall(stream)
        sock = _Capped(a, lambda k, c=cap: c, gathers)
        reader = RespReader(sock)  # type: ignore[arg-type]
        target = bytearray(sum(sizes))
        ends = list(itertools.accumulate(sizes, initial=0))
        got = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20,
                               [memoryview(target)[i:j] for i, j in itertools.pairwise(ends)])
        assert isinstance(got, Landed) and bytes(got.head) + target == value, (sizes, cap)
        assert bytes(reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)) == after, (sizes, cap)
        assert reader.reply() == 7 and reader.idle and sock.received == len(stream), (sizes, cap)


def test_a_values_last_receive_brings_its_crlf_and_the_next_reply(pair: tuple[socket.socket, socket.socket]) -> None:
    """The value's line read alone, the rest of the stream waiting: one `recvmsg_into`
    receives the value's views, its CRLF and the replies after it; reading them makes no
    system call."""
    a, b = pair
    value = bytes(range(256)) * 200
    stream = b"$%d\r\n%s\r\n$5\r\nshort\r\n:7\r\n" % (len(value), value)
    b.sendall(stream)
    line = len(b"$%d\r\n" % len(value))
    sock = _Capped(a, lambda k: line if k == 0 else 1 << 20)
    reader = RespReader(sock)  # type: ignore[arg-type]
    target = bytearray(len(value) - 100)
    got = reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20,
                           [memoryview(target)[i : i + 10_000] for i in range(0, len(target), 10_000)])
    assert isinstance(got, Landed) and bytes(got.head) + target == value and sock.calls == 2
    assert bytes(reader.bulk_into(lambda n: memoryview(bytearray(n)), 1 << 20)) == b"short" and reader.reply() == 7
    assert sock.calls == 2 and reader.idle and sock.received == len(stream)


# -- the tier, against a real server -----------------------------------------------------------
@pytest.mark.parametrize("into", ["rows of out", "contiguous blocks"])
def test_values_land_in_the_callers_blocks_checked_there_with_no_copy(
        server: RedisServer, monkeypatch: pytest.MonkeyPatch, into: str) -> None:
    t, kv = _tokens(6), _kv(6 * BLOCK)
    with _store(server.url) as writer:
        assert writer.store(t, kv) == len(t) and writer.flush()
    with _store(server.url) as reader:
        calls = _Calls(_remote(reader), monkeypatch)
        if into == "rows of out":
            out = torch.zeros_like(kv)
            assert reader.retrieve(t, out=out).num_tokens == len(t)
            assert torch.equal(out, kv)
        else:
            keys = reader.keys(t)
            dsts = [torch.zeros(WIDE.block_shape(BLOCK), dtype=WIDE.dtype) for _ in keys]
            assert reader.blocks.load(keys, dsts).num_blocks == 6
            assert all(torch.equal(d, kv[:, :, i * BLOCK : (i + 1) * BLOCK]) for i, d in enumerate(dsts))
        assert calls.counts == {"take": 0, "take_landed": 6, "copy_out": 0}


def test_a_damaged_payload_that_landed_is_a_counted_miss_deleted_and_ends_the_prefix(
        server: RedisServer) -> None:
    t, kv = _tokens(6, seed=1), _kv(6 * BLOCK, seed=1)
    with _store(server.url) as store:
        assert store.store(t, kv) == len(t) and store.flush()
        key = _remote(store).server_key(store.block_hashes(t)[2])
        raw = redis.Redis(port=server.port)
        length = raw.strlen(key)
        raw.setrange(key, length - 1000, bytes([raw.getrange(key, length - 1000, length - 1000)[0] ^ 0x10]))
        out = torch.zeros_like(kv)
        res = store.retrieve(t, out=out)
        assert res.num_tokens == 2 * BLOCK and torch.equal(out[:, :, : 2 * BLOCK], kv[:, :, : 2 * BLOCK])
        assert _remote(store).stats().num_corrupt == 1
        assert raw.exists(key) == 0  # deleted
        assert store.lookup(t) == 2 * BLOCK


def test_a_record_whose_header_ends_past_where_a_raw_payload_would_begin_is_read_whole(
        server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoded (zstd) record with a long header, longer in all than a raw block: the
    split puts part of its header in the block, so it is joined and read as a whole."""
    t = _tokens(1, seed=2)
    kv = torch.zeros(WIDE.block_shape(BLOCK), dtype=WIDE.dtype)
    kv[0, 0, :, 0, :8] = 1.5  # compressible: zstd makes it smaller
    with _store(server.url, codec="zstd") as writer:
        assert writer.store(t, kv) == BLOCK and writer.flush()
        key = _remote(writer).server_key(writer.block_hashes(t)[0])
    raw = redis.Redis(port=server.port)
    value = raw.get(key)
    assert value is not None and len(value) < WIDE.block_bytes(BLOCK)
    header, payload = parse_record(value, bytes(writer.block_hashes(t)[0]))
    assert header["c"] != 0
    padded = pack_record({**header, "pad": b"\x00" * WIDE.block_bytes(BLOCK)}, payload)
    assert len(padded) > WIDE.block_bytes(BLOCK)
    raw.set(key, bytes(padded))
    with _store(server.url) as reader:
        calls = _Calls(_remote(reader), monkeypatch)
        out = torch.full_like(kv, 3.0)
        assert reader.retrieve(t, out=out).num_tokens == BLOCK and torch.equal(out, kv)
        assert calls.counts["take_landed"] == 1 and calls.counts["take"] == 1  # joined, then taken whole


def test_replies_read_only_to_be_dropped_never_land(server: RedisServer) -> None:
    """One connection, the 4th of 40 blocks absent: the replies after it that were in
    flight are read and dropped, none written into the caller's rows."""
    t, kv = _tokens(40, seed=3), _kv(40 * BLOCK, seed=3)
    with _store(server.url) as store:
        assert store.store(t, kv) == len(t) and store.flush()
        redis.Redis(port=server.port).delete(_remote(store).server_key(store.block_hashes(t)[3]))
        out = torch.zeros_like(kv)
        assert store.retrieve(t, out=out).num_tokens == 3 * BLOCK
        assert torch.equal(out[:, :, : 3 * BLOCK], kv[:, :, : 3 * BLOCK])
        assert not out[:, :, 3 * BLOCK :].any()


def test_blocks_a_value_cannot_land_in_are_read_through_a_record_buffer(server: RedisServer) -> None:
    """Destinations of 256-byte runs (heads outermost): each value is received whole and
    copied out once checked."""
    t, kv = _tokens(3, seed=4), _kv(3 * BLOCK, seed=4)
    with _store(server.url) as store:
        assert store.store(t, kv) == len(t) and store.flush()
        keys = store.keys(t)
        base = torch.zeros((3, WIDE.num_layers, 2, WIDE.num_kv_heads, BLOCK, WIDE.head_dim), dtype=WIDE.dtype)
        dsts = [base[i].transpose(2, 3) for i in range(3)]  # block-shaped, 256-byte runs
        assert _remote(store).codec.landing(dsts[0]) is None
        assert store.blocks.load(keys, dsts).num_blocks == 3
        assert all(torch.equal(d, kv[:, :, i * BLOCK : (i + 1) * BLOCK]) for i, d in enumerate(dsts))


# -- adversarial: what may land, and what may be counted ---------------------------------------
def test_landing_runs_are_the_payloads_bytes_in_order_for_any_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks sliced, permuted and offset out of larger tensors, size-1 dimensions with any
    stride, zero strides (runs of one byte allowed here): writing a payload run by run puts
    exactly it in the block, in its C order, and not one byte outside the block's elements;
    runs that would overlap (a zero stride) are no landing."""
    monkeypatch.setattr(record_module, "MIN_RUN_BYTES", 1)
    rng = random.Random(7)
    landed = 0
    for _ in range(600):
        shape = [rng.choice([1, 1, 2, 3, 4]) for _ in range(rng.randint(1, 5))]
        dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float32])
        codec = RecordCodec(tuple(shape), dtype, verify_tokens=False, namespace=b"n")
        flat = torch.zeros(4096, dtype=dtype)
        big = [n + rng.choice([0, 0, 1, 2]) for n in shape]
        perm = rng.sample(range(len(shape)), len(shape))
        base = flat[rng.randint(0, 9) :][: math.prod(big)].view([big[p] for p in perm])
        base = base.permute([perm.index(d) for d in range(len(shape))])
        dst = base[tuple(slice(at, at + n) for at, n in ((rng.randint(0, b - n), n) for b, n in zip(big, shape)))]
        strides = [rng.choice([0, 7, 300]) if n == 1 and rng.random() < 0.5 else s for n, s in zip(shape, dst.stride())]
        if rng.random() < 0.1 and max(shape) > 1:
            strides[shape.index(max(shape))] = 0  # an expanded dimension: its runs overlap
        dst = torch.as_strided(dst, shape, strides, dst.storage_offset())
        runs = codec.landing(dst)
        if any(n > 1 and s == 0 for n, s in zip(shape, strides)):
            assert runs is None  # its runs would overlap
            continue
        if runs is None:
            continue
        landed += 1
        payload = torch.randint(1, 256, (codec.block_bytes,), dtype=torch.uint8)
        mine = torch.zeros(flat.numel(), dtype=torch.bool)
        torch.as_strided(mine, shape, dst.stride(), dst.storage_offset()).fill_(True)
        before = flat.clone()
        at = 0
        for run in runs:
            run[:] = payload[at : at + run.nbytes].numpy().tobytes()
            at += run.nbytes
        assert at == codec.block_bytes and torch.equal(dst.contiguous().view(torch.uint8).flatten(), payload)
        assert torch.equal(flat[~mine].view(torch.uint8), before[~mine].view(torch.uint8))
    assert landed > 100


def _crafted(case: str, value: bytes, block_hash: bytes) -> bytes:
    """Block `block_hash`'s sound record `value` made into what a buggy or hostile server
    could hold under its key."""
    header, payload = parse_record(value, block_hash)
    block = WIDE.block_bytes(BLOCK)
    if case == "a block's bytes exactly":
        return value[-block:]
    if case == "a block's bytes and five more":
        return value[-block - 5 :]
    if case == "the record and three bytes more":
        return value + b"abc"
    if case == "a header length pointing into the payload":  # resealed: its checksum holds
        moved = bytearray(value)
        struct.pack_into("<I", moved, 4, struct.unpack_from("<I", moved, 4)[0] + 8)
        h = xxhash.xxh3_64(bytes(moved[:8]))
        h.update(bytes(moved[16:]))  # the checksum covers the magic, the length, then all past the prefix
        struct.pack_into("<Q", moved, 8, h.intdigest())
        return bytes(moved)
    changed = {"another namespace": {"ns": b"other"}, "another key": {"key": b"\x01" * len(block_hash)},
               "another layout": {"shape": [WIDE.num_layers, 2, BLOCK, WIDE.num_kv_heads // 2, 2 * WIDE.head_dim]},
               "a raw payload said to be zstd": {"c": CodecKind.ZSTD.value, "el": "bfloat16"}}[case]
    return bytes(pack_record({**header, **changed}, payload))


@pytest.mark.parametrize("case", ["a block's bytes exactly", "a block's bytes and five more",
                                  "the record and three bytes more", "a header length pointing into the payload",
                                  "another namespace", "another key", "another layout",
                                  "a raw payload said to be zstd"])
def test_a_crafted_value_under_a_blocks_key_is_a_counted_miss_never_a_hit(server: RedisServer, case: str) -> None:
    """Whatever lengths and fields a value under block 2's key has (whole, landed, or
    landed then joined), it is a counted miss that ends the prefix there and is deleted;
    the blocks before it are exact."""
    t, kv = _tokens(4, seed=8), _kv(4 * BLOCK, seed=8)
    with _store(server.url) as store:
        assert store.store(t, kv) == len(t) and store.flush()
        block_hash = bytes(store.block_hashes(t)[2])
        key = _remote(store).server_key(store.block_hashes(t)[2])
        raw = redis.Redis(port=server.port)
        raw.set(key, _crafted(case, raw.get(key), block_hash))
        out = torch.zeros_like(kv)
        assert store.retrieve(t, out=out).num_tokens == 2 * BLOCK
        assert torch.equal(out[:, :, : 2 * BLOCK], kv[:, :, : 2 * BLOCK])
        assert _remote(store).stats().num_corrupt == 1 and raw.exists(key) == 0


def _missing(why: str) -> None:
    """Skip; a failure under KVSTRATA_TEST_REQUIRE_REDIS=1 (CI installs a server with TLS)."""
    if os.environ.get("KVSTRATA_TEST_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVSTRATA_TEST_REQUIRE_REDIS=1 but {why}")
    pytest.skip(why)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    """A real redis-server speaking TLS on a port of its own (a self-signed certificate),
    plain TCP on its usual one; skipped (failed in CI) where openssl or the server's TLS is
    missing."""
    need_redis()
    if shutil.which("openssl") is None:
        _missing("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    with contextlib.ExitStack() as stack:
        try:
            s = stack.enter_context(redis_server("--tls-port", str(port), "--tls-cert-file", str(cert),
                                                 "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                                                 "--tls-auth-clients", "no"))
        except RedisServerError:
            _missing("this redis-server has no TLS")
        yield s, f"rediss://127.0.0.1:{port}?ssl_cert_reqs=none"


def test_over_tls_values_land_run_by_run_and_a_damaged_one_is_a_counted_miss(
        tls_server: tuple[RedisServer, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`rediss://` (no `recvmsg_into` on a TLS socket): each value lands run by run in the
    rows of `out`, exact, with lanes; a value damaged in its payload ends the prefix."""
    server, url = tls_server
    t, kv = _tokens(24, seed=9), _kv(24 * BLOCK, seed=9)
    with _store(url, connections_per_node=4) as store:
        assert store.store(t, kv) == len(t) and store.flush()
        calls = _Calls(_remote(store), monkeypatch)
        out = torch.zeros_like(kv)
        assert store.retrieve(t, out=out).num_tokens == len(t) and torch.equal(out, kv)
        assert calls.counts == {"take": 0, "take_landed": 24, "copy_out": 0}
        key = _remote(store).server_key(store.block_hashes(t)[5])
        raw = redis.Redis(port=server.port)
        raw.setrange(key, raw.strlen(key) - 1, b"\xff" if raw.getrange(key, -1, -1) != b"\xff" else b"\x00")
        out = torch.zeros_like(kv)
        assert store.retrieve(t, out=out).num_tokens == 5 * BLOCK
        assert torch.equal(out[:, :, : 5 * BLOCK], kv[:, :, : 5 * BLOCK])
        assert _remote(store).stats().num_corrupt == 1
