"""Codecs inside stores: what the disk and remote tiers return through each codec, which
stores share records, and what a damaged or unreadable encoded record becomes.

Real disk tiers (slot files and their LMDB index) and real redis-server processes. A
lossless record comes back bit-exact to every reader; a lossy one within the codec's bound,
and only to stores whose identity names a lossy codec, in both directions and in every tier.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from cli.redis_servers import RedisServer, redis_server
from kvstore import KVCacheStore, KVLayout, StoreConfig
from kvstore.errors import ConfigError
from tests.reliability import diskdamage
from tiers.codecs import CodecKind, CodecSpec, build_codec, parse_codec
from tiers.codecs.scaled import ScaledCodec
from tiers.disk.codec import encoded_slot_bytes
from tiers.disk.files import slot_bytes_for
from tiers.disk.index import pack_entry
from tiers.disk.payload import payload_sum
from tiers.disk.tier import LMDBTier, PayloadLocation, bytes_per_block
from tiers.keys import BlockKey, TierKind
from tiers.remote.tier import RemoteTier
from tiers.shared.record import RecordCodec, pack_record, parse_record

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
BLOCK = 16
TOKENS = np.arange(3 * BLOCK, dtype=np.uint32) + 7


def kv(num_tokens: int = len(TOKENS), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LAYOUT.block_shape(num_tokens), generator=g)
    x[:, 0, :, :, 5] *= 20  # an outlier key channel
    return x.to(LAYOUT.dtype)


def open_store(path: Path, *, cpu: bool = False, remote: str | None = None, disk: bool = True,
               **overrides: object) -> KVCacheStore:
    kwargs: dict[str, object] = {
        "layout": LAYOUT, "block_size": BLOCK, "namespace": "codec-test",
        "cpu_bytes": 8 * LAYOUT.block_bytes(BLOCK) if cpu else 0, "disk_path": str(path) if disk else None,
        "disk_bytes": 16 << 20, "disk_sync": False, "remote_url": remote, "load_policy": "always",
    }
    kwargs.update(overrides)
    return KVCacheStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def tier(store: KVCacheStore, kind: TierKind) -> LMDBTier | RemoteTier:
    found = [t for t in store.tiers if t.kind is kind]
    assert found and isinstance(found[0], (LMDBTier, RemoteTier))
    return found[0]


def blockwise_bound(kind: CodecKind, x: torch.Tensor) -> torch.Tensor:
    codec = build_codec(kind, LAYOUT.block_shape(BLOCK), LAYOUT.dtype)
    assert isinstance(codec, ScaledCodec)
    parts = [codec.error_bound(x[:, :, i : i + BLOCK].contiguous()) for i in range(0, x.shape[2], BLOCK)]
    return torch.cat(parts, dim=2)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def test_identity_names_lossy_codecs_only(tmp_path: Path) -> None:
    exact = StoreConfig(LAYOUT, BLOCK, namespace="n", disk_path=str(tmp_path))
    assert exact.identity() == ["n", 2, 2, 32, "bfloat16", BLOCK, "xxh3_128"]  # as before codecs existed
    assert StoreConfig(LAYOUT, BLOCK, namespace="n", disk_path=str(tmp_path), disk_codec="zstd").identity() == \
        exact.identity()
    lossy = StoreConfig(LAYOUT, BLOCK, namespace="n", disk_path=str(tmp_path), disk_codec="int8")
    assert lossy.disk_codec is CodecKind.INT8
    assert lossy.identity() == [*exact.identity(), ["lossy", ["int8"], None, None]]
    # a codec of a tier that is not enabled changes nothing
    assert StoreConfig(LAYOUT, BLOCK, namespace="n", disk_path=str(tmp_path), remote_codec="fp8").identity() == \
        exact.identity()


def test_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"StoreConfig\.disk_codec must be one of .* got 'lz4'"):
        StoreConfig(LAYOUT, BLOCK, disk_path=str(tmp_path), disk_codec="lz4")
    with pytest.raises(ConfigError, match=r"StoreConfig\.codec_dtype=torch\.float16 differs from the layout's"):
        StoreConfig(LAYOUT, BLOCK, disk_path=str(tmp_path), disk_codec="int8", codec_dtype="float16")
    opaque = KVLayout(2, 1, 128, torch.uint8)
    with pytest.raises(ConfigError, match=r"StoreConfig\.remote_codec='int8': the int8 codec quantizes .* not "
                                          r"torch\.uint8; give the KV's element dtype \(codec_dtype\)"):
        StoreConfig(opaque, BLOCK, remote_url="redis://127.0.0.1:1", remote_codec="int8")
    with pytest.raises(ConfigError, match=r"StoreConfig\.codec_group must be an int > 0, got 0"):
        StoreConfig(opaque, BLOCK, disk_path=str(tmp_path), codec_group=0)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ConfigError, match=r"StoreConfig\.disk_codec='zstd': .*pip install 'kvstrata\[codec\]'"):
        StoreConfig(LAYOUT, BLOCK, disk_path=str(tmp_path), disk_codec="zstd")


@pytest.mark.parametrize("kind", list(CodecKind))
def test_disk_round_trip(tmp_path: Path, kind: CodecKind) -> None:
    x = kv()
    with open_store(tmp_path, disk_codec=kind) as store:
        assert store.store(TOKENS, x) == len(TOKENS)
        locations = _locations(store)
        capacity = tier(store, TierKind.DISK).capacity_blocks
    with open_store(tmp_path, disk_codec=kind) as store:  # reopened: nothing in memory
        got = store.retrieve(TOKENS)
        assert got.num_tokens == len(TOKENS) and got.blocks_per_tier == {TierKind.DISK: 3}
        assert got.kv is not None
        if kind.lossy:
            err = (got.kv.float() - x.float()).abs()
            assert bool((err <= blockwise_bound(kind, x)).all()) and float(err.max()) > 0
        else:
            assert torch.equal(got.kv.view(torch.uint8), x.view(torch.uint8))
        store.check_integrity()
    raw = LAYOUT.block_bytes(BLOCK)
    assert all(loc.codec_id == kind.value for loc in locations)
    if kind is not CodecKind.NONE:
        assert max(loc.length for loc in locations) < (0.95 if kind is CodecKind.ZSTD else 0.6) * raw
    # a lossy codec's payloads have one size: its blocks take smaller slots, so more fit
    slots = {Path(loc.file).name for loc in locations}
    if kind.lossy:
        assert slots == {f"slots-{encoded_slot_bytes(locations[0].length)}.kvd"}
        assert encoded_slot_bytes(locations[0].length) < slot_bytes_for(raw)
        assert capacity > (16 << 20) // bytes_per_block(raw)
    else:  # raw and zstd payloads take raw-size slots (zstd writes only its encoded length)
        assert slots == {f"slots-{slot_bytes_for(raw)}.kvd"}


def test_load_policy_measures_decoded_bytes(tmp_path: Path) -> None:
    """The policy's disk bandwidth counts the bytes a load delivers, not the fewer it read."""
    x = kv()
    with open_store(tmp_path, disk_codec="k8v4") as store:
        store.store(TOKENS, x)
        stored = sum(loc.length for loc in _locations(store))
    with open_store(tmp_path, disk_codec="k8v4", load_policy="auto") as store:
        seen: list[tuple[TierKind, int, float]] = []
        observe = store.load_policy.observe_load
        store.load_policy.observe_load = lambda kind, n, s: (seen.append((kind, n, s)), observe(kind, n, s))[1]  # type: ignore[method-assign]
        assert store.retrieve(TOKENS).num_tokens == len(TOKENS)
        assert [(k, n) for k, n, _ in seen] == [(TierKind.DISK, 3 * LAYOUT.block_bytes(BLOCK))]
        assert stored < 0.5 * seen[0][1]
        assert store.load_policy.bandwidth(TierKind.DISK) == pytest.approx(seen[0][1] / seen[0][2])


def test_non_finite_blocks_are_stored_raw(tmp_path: Path) -> None:
    x = kv()
    x[1, 0, BLOCK + 3, 1, 7] = float("inf")  # the second block cannot be scaled
    with open_store(tmp_path, disk_codec="int8") as store:
        store.store(TOKENS, x)
        codecs = [loc.codec_id for loc in _locations(store)]
        assert codecs == [CodecKind.INT8.value, 0, CodecKind.INT8.value]
        got = store.retrieve(TOKENS)
        assert got.kv is not None and torch.equal(got.kv[:, :, BLOCK : 2 * BLOCK], x[:, :, BLOCK : 2 * BLOCK])


def test_blocks_a_lossless_codec_cannot_shrink_are_stored_raw(tmp_path: Path) -> None:
    x = kv()
    x.view(torch.uint8)[:, :, :BLOCK] = torch.randint(0, 256, x.view(torch.uint8)[:, :, :BLOCK].shape,
                                                      dtype=torch.uint8)  # the first block: noise
    x[:, :, :BLOCK] = x[:, :, :BLOCK].nan_to_num()
    with open_store(tmp_path, disk_codec="zstd") as store:
        store.store(TOKENS, x)
        locations = _locations(store)
        assert [loc.codec_id for loc in locations] == [0, CodecKind.ZSTD.value, CodecKind.ZSTD.value]
        assert locations[0].length == LAYOUT.block_bytes(BLOCK)  # raw: never more than the block
        got = store.retrieve(TOKENS)
        assert got.kv is not None and torch.equal(got.kv.view(torch.uint8), x.view(torch.uint8))


def test_lossless_records_are_shared_with_exact_stores(tmp_path: Path) -> None:
    x = kv()
    with open_store(tmp_path, disk_codec="zstd") as store:
        store.store(TOKENS, x)
    with open_store(tmp_path) as exact:  # writes raw, reads zstd records: the same identity
        got = exact.retrieve(TOKENS)
        assert got.num_tokens == len(TOKENS) and got.kv is not None
        assert torch.equal(got.kv.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("writer_codec, reader_codec", [("int8", "none"), ("none", "int8"), ("int8", "fp8"),
                                                        ("int8", "zstd")])
def test_lossy_and_other_stores_share_nothing(tmp_path: Path, server: RedisServer, writer_codec: str,
                                              reader_codec: str) -> None:
    """Disk and remote, with a CPU tier in front: the reader finds none of the writer's blocks."""
    x = kv()
    with open_store(tmp_path / "a", cpu=True, remote=server.url, disk_codec=writer_codec,
                    remote_codec=writer_codec) as writer:
        writer.store(TOKENS, x)
        assert writer.flush()
        assert writer.retrieve(TOKENS).num_tokens == len(TOKENS)
    with open_store(tmp_path / "a", cpu=True, remote=server.url, disk_codec=reader_codec,
                    remote_codec=reader_codec) as reader:
        assert reader.lookup(TOKENS) == 0 and reader.retrieve(TOKENS).num_tokens == 0
        assert tier(reader, TierKind.REMOTE).num_unverifiable == 0  # other keys: never even read


def test_lossy_record_under_an_exact_key_is_refused(tmp_path: Path, server: RedisServer) -> None:
    """A lossy record planted under an exact store's key (its namespace tag, valid checksum) is a
    miss and stays, in the disk and the remote tier; the lossy reader it was meant for reads it."""
    x = kv(BLOCK)
    with open_store(tmp_path, remote=server.url) as exact:
        key = BlockKey(exact.block_hashes(TOKENS[:BLOCK])[0], TOKENS[:BLOCK].tobytes())
        disk, remote = tier(exact, TierKind.DISK), tier(exact, TierKind.REMOTE)
        # a disk tier writing int8 under the exact store's namespace: its entry and checksum are sound
        planter = LMDBTier(str(tmp_path), 16 << 20, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, sync=False,
                           namespace=exact.seed, codec=CodecSpec(CodecKind.INT8))
        try:
            assert planter.put([key], [x]) == 1
            loc = planter.payload_location(key.block_hash)
            assert loc is not None and loc.codec_id == CodecKind.INT8.value
            dst = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            assert planter.get_into([key], [dst]) == 1  # the lossy reader it was meant for reads it
            assert bool(((dst.float() - x.float()).abs() <= blockwise_bound(CodecKind.INT8, x)).all())
        finally:
            planter.close()
        lossy = RecordCodec(LAYOUT.block_shape(BLOCK), LAYOUT.dtype, verify_tokens=True, namespace=exact.seed,
                            codec=CodecSpec(CodecKind.INT8))
        record = bytes(lossy.encode(key, x))
        remote.put([key], [x])  # then overwrite the value with the lossy record
        assert remote.flush()
        import redis

        redis.Redis.from_url(server.url).set(remote.server_key(key.block_hash), record)
        for t in (disk, remote):
            out = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            assert t.get_into([key], [out]) == 0
            assert t.match_prefix([key.block_hash]) == 1  # left in place
        assert remote.num_unverifiable == disk.num_unverifiable == 1
        assert disk.counters.num_corrupt == remote.counters.num_corrupt == 0
        assert disk.scrub().num_corrupt == 0
        dst = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
        lossy.copy_out(lossy.decode(record, key), dst)
        assert bool(((dst.float() - x.float()).abs() <= blockwise_bound(CodecKind.INT8, x)).all())


def test_zstd_payloads_of_another_element_dtype_are_a_miss_left_in_place(tmp_path: Path) -> None:
    """zstd's byte planes follow the element dtype: an opaque-layout store that reads pages as
    bytes must not decode planes split as bfloat16 (it would return permuted bytes). Both stores
    are exact and share the namespace; the reader's miss leaves the block to its writer."""
    opaque = KVLayout(2, 2, 64, torch.uint8)
    x = kv(BLOCK).view(torch.uint8).reshape(opaque.block_shape(BLOCK)).clone()
    with open_store(tmp_path, layout=opaque, disk_codec="zstd", codec_dtype=torch.bfloat16) as writer:
        assert writer.store(TOKENS[:BLOCK], x) == BLOCK
        loc, = _locations(writer)
        assert loc.codec_id == CodecKind.ZSTD.value
    with open_store(tmp_path, layout=opaque) as bytewise:  # same identity, planes of one byte
        assert bytewise.lookup(TOKENS[:BLOCK]) == BLOCK
        assert bytewise.retrieve(TOKENS[:BLOCK]).num_tokens == 0
        disk = tier(bytewise, TierKind.DISK)
        assert isinstance(disk, LMDBTier) and disk.num_unverifiable == 1 and disk.counters.num_corrupt == 0
        assert bytewise.lookup(TOKENS[:BLOCK]) == BLOCK  # left in place
    with open_store(tmp_path, layout=opaque, codec_dtype=torch.bfloat16) as planes:  # exact, bfloat16 planes
        got = planes.retrieve(TOKENS[:BLOCK])
        assert got.num_tokens == BLOCK and got.kv is not None and torch.equal(got.kv, x)


def test_unknown_codec_is_a_miss_left_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = kv(BLOCK)
    with open_store(tmp_path, disk_codec="zstd") as store:
        store.store(TOKENS[:BLOCK], x)
        loc, = _locations(store)
        h, seed = store.block_hashes(TOKENS[:BLOCK])[0], store.seed
    key = BlockKey(h, TOKENS[:BLOCK].tobytes())
    sound = diskdamage.read_entry(tmp_path, loc.index_key)
    _rewrite_entry(tmp_path, loc, codec=250)  # a codec of some later kvstrata, checksum and all
    for codec in ("zstd", "none"):
        reader = LMDBTier(str(tmp_path), 16 << 20, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=seed,
                          codec=CodecSpec(parse_codec(codec)))
        try:
            out = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            assert reader.get_into([key], [out]) == 0 and reader.match_prefix([h]) == 1
            assert reader.num_unverifiable == 1 and reader.scrub().num_corrupt == 0
        finally:
            reader.close()
    diskdamage.put_entries(tmp_path, {loc.index_key: pack_entry(sound)})
    monkeypatch.setitem(sys.modules, "zstandard", None)  # a reader without the library
    reader = LMDBTier(str(tmp_path), 16 << 20, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=seed)
    try:
        out = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
        assert reader.get_into([key], [out]) == 0 and reader.match_prefix([h]) == 1
        assert reader.counters.num_corrupt == 0 and reader.scrub().num_corrupt == 0
        assert reader.match_prefix([h]) == 1
    finally:
        reader.close()


@pytest.mark.parametrize("kind", [k for k in CodecKind if k is not CodecKind.NONE])
def test_damaged_encoded_disk_payloads_are_misses_and_deleted(tmp_path: Path, kind: CodecKind) -> None:
    """A flipped payload bit fails the checksum; a payload that fails to decode under a valid
    checksum (a hostile or buggy writer) fails in the codec. Both are deleted as damage."""
    x = kv(BLOCK)
    for damage in ("bit", "undecodable"):
        path = tmp_path / damage
        with open_store(path, disk_codec=kind) as store:
            store.store(TOKENS[:BLOCK], x)
            loc, = _locations(store)
            key = BlockKey(store.block_hashes(TOKENS[:BLOCK])[0], TOKENS[:BLOCK].tobytes())
        if damage == "bit":
            diskdamage.damage_payload(loc, "payload-bit", np.random.default_rng(int(kind.value)))
        else:
            payload = bytearray(diskdamage.read_payload(loc))
            if kind is CodecKind.ZSTD:
                payload[-4:] = b"\xff\xff\xff\xff"
            else:
                payload[0:2] = b"\0\0"  # a zero scale
            _rewrite_entry(path, loc, payload=bytes(payload))
        with open_store(path, disk_codec=kind) as store:
            disk = tier(store, TierKind.DISK)
            out = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            assert disk.get_into([key], [out]) == 0
            assert disk.match_prefix([key.block_hash]) == 0  # deleted
            assert disk.counters.num_corrupt == 1
            disk.check_integrity()


@pytest.mark.parametrize("kind", [k for k in CodecKind if k is not CodecKind.NONE])
def test_damaged_encoded_records_are_misses_and_deleted(server: RedisServer, kind: CodecKind) -> None:
    x = kv(BLOCK)
    with open_store(Path("unused"), disk=False, remote=server.url, remote_codec=kind) as store:
        store.store(TOKENS[:BLOCK], x)
        assert store.flush()
        key = BlockKey(store.block_hashes(TOKENS[:BLOCK])[0], TOKENS[:BLOCK].tobytes())
        remote = tier(store, TierKind.REMOTE)
        import redis

        client = redis.Redis.from_url(server.url)
        value = client.get(remote.server_key(key.block_hash))
        # a flipped payload bit fails the checksum; a payload that fails to decode under a
        # valid checksum (a hostile or buggy writer) fails in the codec
        for damaged in (_flip_last(value), _undecodable(value, key)):
            client.set(remote.server_key(key.block_hash), damaged)
            out = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            assert remote.get_into([key], [out]) == 0
            assert remote.match_prefix([key.block_hash]) == 0  # deleted
        assert remote.counters.num_corrupt == 2


# -- helpers -------------------------------------------------------------------------------
def _locations(store: KVCacheStore) -> list[PayloadLocation]:
    """Where each stored block of `TOKENS` lies (prefix order), for the blocks held."""
    disk = tier(store, TierKind.DISK)
    assert isinstance(disk, LMDBTier)
    found = [disk.payload_location(h) for h in store.block_hashes(TOKENS)]
    return [loc for loc in found if loc is not None]


def _rewrite_entry(path: Path, loc: PayloadLocation, *, codec: int | None = None, payload: bytes | None = None) -> None:
    """Give the block at `loc` another codec id or payload, with a checksum that holds (what a
    later kvstrata, or a buggy writer, would leave). The directory must not be open."""
    e = diskdamage.read_entry(path, loc.index_key)
    if codec is not None:
        e = e._replace(codec=codec)
    if payload is not None:
        with open(loc.file, "r+b") as f:
            f.seek(loc.offset)
            f.write(payload)
    data = payload if payload is not None else diskdamage.read_payload(loc)
    e = e._replace(xxh=payload_sum(loc.index_key, e, [np.frombuffer(data, np.uint8)]))
    diskdamage.put_entries(path, {loc.index_key: pack_entry(e)})


def _flip_last(record: bytes) -> bytes:
    return record[:-1] + bytes([record[-1] ^ 0x10])


def _undecodable(record: bytes, key: BlockKey) -> bytes:
    """The record with a payload its codec refuses (a zero scale, or a broken zstd frame),
    sealed again with a checksum that holds."""
    header, view = parse_record(record, key.block_hash)
    payload = bytearray(view)
    if header["c"] == CodecKind.ZSTD.value:
        payload[-4:] = b"\xff\xff\xff\xff"
    else:
        payload[0:2] = b"\0\0"
    return bytes(pack_record(header, payload))
