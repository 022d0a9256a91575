"""The remote tier's records (`tiers/shared/record.py`): every header field that decoding depends
on is under the checksum, so a flipped bit anywhere in a record is a counted miss, never a hit
with other bytes; records of the first format (whose checksum left the codec out) are never
decoded; an encoding of another element dtype is a miss, not permuted bytes. Real
redis-server processes where a store reads.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import torch
import xxhash

from kvstore import KVCacheStore, KVLayout, StoreConfig
from tests.redis_fixtures import RedisServer, redis_server
from tiers.codecs import CodecKind, CodecSpec
from tiers.errors import CorruptRecordError, UnverifiableRecordError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.remote.tier import RemoteTier
from tiers.shared.record import RecordCodec

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
BLOCK = 16
TOKENS = np.arange(3 * BLOCK, dtype=np.uint32) + 11


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def _kv(num_tokens: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(layout.block_shape(num_tokens), generator=g)
    x[:, 0, :, :, 5] *= 20  # an outlier key channel: int8 and fp8 codes differ most
    return x.to(layout.dtype)


def _store(path: Path, url: str, layout: KVLayout = LAYOUT, **overrides: object) -> KVCacheStore:
    kwargs: dict[str, object] = {"layout": layout, "block_size": BLOCK, "namespace": "records", "cpu_bytes": 0,
                                 "disk_path": str(path), "disk_bytes": 16 << 20, "disk_sync": False,
                                 "remote_url": url, "load_policy": "always"}
    kwargs.update(overrides)
    return KVCacheStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def _remote(store: KVCacheStore) -> RemoteTier:
    tier = store.tiers[-1]
    assert isinstance(tier, RemoteTier) and tier.kind is TierKind.REMOTE
    return tier


def test_a_flipped_codec_id_is_a_corrupt_miss_not_a_hit(server: RedisServer, tmp_path: Path) -> None:
    """A store whose tiers accept int8 and fp8 (disk int8, remote fp8): one bit of the remote
    record's codec id turned fp8 into int8 (same payload length). The read is a miss counted
    as corrupt and the record is deleted; the blocks before it still hit."""
    x = _kv(len(TOKENS))
    with _store(tmp_path / "a", server.url, disk_codec="int8", remote_codec="fp8") as writer:
        assert writer.store(TOKENS, x) == len(TOKENS)
        assert writer.flush()
        key = _remote(writer).server_key(writer.block_hashes(TOKENS)[1])
    raw = redis.Redis(port=server.port)
    value = raw.get(key)
    assert value is not None and value.count(b"\xa1c\x03") == 1  # msgpack "c": 3 (fp8)
    raw.set(key, value.replace(b"\xa1c\x03", b"\xa1c\x02"))  # int8: one bit
    with _store(tmp_path / "b", server.url, disk_codec="int8", remote_codec="fp8") as reader:  # empty disk
        res = reader.retrieve(TOKENS)
        tier = _remote(reader)
        assert res.num_tokens == BLOCK, "a record whose codec id was flipped was decoded"
        assert res.blocks_per_tier == {TierKind.REMOTE: 1}
        assert tier.stats().num_corrupt == 1 and tier.num_unverifiable == 0
        assert raw.get(key) is None, "the damaged record was not deleted"


def _record_v1(codec: RecordCodec, key: BlockKey, x: torch.Tensor, namespace: bytes) -> bytes:
    """A sound record of the first format (b"KVS1"), as kvstrata wrote them: its checksum
    covered key, namespace, tokens and payload only."""
    payload = x.contiguous().view(torch.uint8).numpy().tobytes()
    h = xxhash.xxh3_64()
    for part in (key.block_hash, namespace + key.tokens, payload):
        h.update(part)
    header = msgpack.packb({"v": 1, "key": bytes(key.block_hash), "ns": namespace, "dtype": "bfloat16",
                            "shape": list(LAYOUT.block_shape(BLOCK)), "n": len(payload), "tok": key.tokens,
                            "xxh": h.digest()}, use_bin_type=True)
    return b"KVS1" + struct.pack("<I", len(header)) + header + payload


def test_a_record_of_the_first_format_is_a_counted_miss_never_decoded(server: RedisServer) -> None:
    ns = b"first-format"
    tier = RemoteTier(server.url, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=ns)
    try:
        x = _kv(BLOCK)
        key = BlockKey(BlockHash(b"\x01" * 16), TOKENS[:BLOCK].tobytes())
        raw = redis.Redis(port=server.port)
        raw.set(tier.server_key(key.block_hash), _record_v1(tier.codec, key, x, ns))
        out = torch.zeros_like(x)
        assert tier.get_into([key], [out]) == 0
        assert tier.num_unverifiable == 1 and tier.stats().num_corrupt == 0
        assert raw.exists(tier.server_key(key.block_hash)) == 1  # left in place: sound for the old format
        assert tier.put([key], [x]) == 1 and tier.flush()  # written again in the new format: a hit
        assert tier.get_into([key], [out]) == 1 and torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    finally:
        tier.close()


@pytest.mark.parametrize("kind", [CodecKind.NONE, CodecKind.INT8, CodecKind.FP8])
def test_any_flipped_bit_outside_the_payload_is_never_decoded(kind: CodecKind) -> None:
    """Every bit of the prefix and header, flipped one at a time: each record is refused
    (damage; or a record of the first format), none decodes."""
    spec = CodecSpec(kind, accepted=frozenset({CodecKind.INT8, CodecKind.FP8}))
    codec = RecordCodec(LAYOUT.block_shape(BLOCK), LAYOUT.dtype, verify_tokens=True, namespace=b"ns", codec=spec)
    key = BlockKey(BlockHash(b"\x02" * 16), TOKENS[:BLOCK].tobytes(), BlockHash(b"\x03" * 16), b"")
    record = bytes(codec.encode(key, _kv(BLOCK)))
    header_end = 16 + int.from_bytes(record[4:8], "little")
    decoded = 0
    dst = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
    for pos in range(header_end):
        for bit in range(8):
            bad = bytearray(record)
            bad[pos] ^= 1 << bit
            try:
                codec.copy_out(codec.decode(bytes(bad), key), dst)
            except (CorruptRecordError, UnverifiableRecordError):
                continue
            decoded += 1
    assert decoded == 0, f"{decoded} records with a flipped header bit decoded"


def test_a_zstd_record_of_another_element_dtype_is_a_miss_left_in_place(server: RedisServer, tmp_path: Path) -> None:
    """Opaque (uint8) pages: a store that splits zstd byte planes as bfloat16 and one that reads
    pages as bytes share the namespace (zstd is lossless); the byte reader must not decode the
    bfloat16 planes (it would return permuted bytes): a miss, left to its writer."""
    opaque = KVLayout(2, 2, 64, torch.uint8)
    x = _kv(BLOCK).view(torch.uint8).reshape(opaque.block_shape(BLOCK)).clone()
    with _store(tmp_path / "a", server.url, opaque, remote_codec="zstd", codec_dtype=torch.bfloat16) as writer:
        assert writer.store(TOKENS[:BLOCK], x) == BLOCK and writer.flush()
        key = _remote(writer).server_key(writer.block_hashes(TOKENS[:BLOCK])[0])
    value = redis.Redis(port=server.port).get(key)
    assert value is not None and b"\xa1c\x01" in value  # stored as zstd
    with _store(tmp_path / "b", server.url, opaque) as bytewise:  # same identity, planes of one byte
        assert bytewise.lookup(TOKENS[:BLOCK]) == BLOCK
        assert bytewise.retrieve(TOKENS[:BLOCK]).num_tokens == 0
        tier = _remote(bytewise)
        assert tier.num_unverifiable == 1 and tier.stats().num_corrupt == 0
        assert bytewise.lookup(TOKENS[:BLOCK]) == BLOCK  # left in place
    with _store(tmp_path / "c", server.url, opaque, codec_dtype=torch.bfloat16) as same:  # its writer's kind reads it
        got = same.retrieve(TOKENS[:BLOCK])
        assert got.num_tokens == BLOCK and got.kv is not None and torch.equal(got.kv, x)
