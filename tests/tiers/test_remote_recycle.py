"""The remote tier's reused record buffers, against a real redis-server: records of large
blocks are encoded into buffers the writer has finished with (never into one still queued or
being sent), bit-exact across reuse, and released when the tier is idle."""

from __future__ import annotations

import time

import torch
import xxhash

from cli.redis_servers import redis_server
from kvstore import KVLayout
from tiers.keys import BlockHash, BlockKey
from tiers.remote.tier import RemoteTier

TWO_MIB = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 16 tokens: 2 MiB
BLOCK = 16


def _blocks(n: int, seed: int) -> tuple[list[BlockKey], list[torch.Tensor]]:
    keys = [BlockKey(BlockHash(xxhash.xxh3_128_digest(f"{seed}:{i}".encode()))) for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    shape = TWO_MIB.block_shape(BLOCK)
    srcs = [torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32).to(torch.int16)
            .view(torch.bfloat16) for _ in range(n)]
    return keys, srcs


def _read_back(tier: RemoteTier, keys: list[BlockKey], srcs: list[torch.Tensor]) -> None:
    out = [torch.zeros_like(s) for s in srcs]
    assert tier.get_into(keys, out) == len(keys)
    for got, want in zip(out, srcs):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_large_records_reuse_sent_buffers_and_stay_bit_exact() -> None:
    """Three puts of 24 blocks of 2 MiB through a queue of 8 MiB, one after another without
    waiting: most records are encoded into buffers of records already sent (a fresh one each
    faulted in 2 MiB), and every block of every put reads back bit-exact: no buffer was
    reused while its record was still waiting or being sent."""
    puts = [_blocks(24, seed) for seed in (1, 2, 3)]
    with redis_server("--maxmemory", "1gb") as server:
        tier = RemoteTier(server.url, TWO_MIB.block_shape(BLOCK), TWO_MIB.dtype, namespace=b"recycle-test",
                          max_pending_bytes=8 << 20)
        try:
            for keys, srcs in puts:
                assert tier.put(keys[::-1], srcs[::-1]) == len(keys)
            assert tier.flush() and tier.num_write_drops == 0
            assert tier._buffers.num_reused >= 48, tier._buffers.num_reused
            assert 0 < tier._buffers.free_bytes <= (8 << 20) + tier._buffers.size
            for keys, srcs in puts:
                _read_back(tier, keys, srcs)
        finally:
            tier.close()


def test_an_idle_tier_releases_its_record_buffers() -> None:
    keys, srcs = _blocks(4, 4)
    with redis_server() as server:
        tier = RemoteTier(server.url, TWO_MIB.block_shape(BLOCK), TWO_MIB.dtype, namespace=b"recycle-test")
        try:
            assert tier.put(keys[::-1], srcs[::-1]) == 4 and tier.flush()
            assert tier._buffers.free_bytes > 0
            deadline = time.monotonic() + 30
            while tier._buffers.free_bytes and time.monotonic() < deadline:
                time.sleep(0.2)
            assert tier._buffers.free_bytes == 0, "the buffers stayed after the writer was idle"
            _read_back(tier, keys, srcs)
        finally:
            tier.close()


def test_a_record_whose_header_outgrows_the_buffer_is_built_fresh() -> None:
    """Token ids longer than a reused buffer's room for the header (10 KiB of them): that
    block's record is built in a fresh buffer and reads back bit-exact, token ids checked;
    blocks with short headers still reuse."""
    keys, srcs = _blocks(6, 5)
    keys[2] = keys[2]._replace(tokens=bytes(range(256)) * 40)
    with redis_server() as server:
        tier = RemoteTier(server.url, TWO_MIB.block_shape(BLOCK), TWO_MIB.dtype, namespace=b"recycle-test",
                          max_pending_bytes=4 << 20)
        try:
            assert tier.put(keys[::-1], srcs[::-1]) == 6 and tier.flush() and tier.num_write_drops == 0
            _read_back(tier, keys, srcs)
            assert tier._buffers.num_reused > 0
        finally:
            tier.close()
