"""Damage to each sub-database of the disk tier's index (`index`, `order`, `free`, `log`,
`meta`: keys and values), written with the lmdb module while the tier is closed. Reopened,
the tier must store, retrieve, look up, scrub, clear and close without an exception, return
only exact bytes, count the damage, and be left sound (a second scrub finds nothing, the
invariants hold); files kvstrata did not create stay."""

from __future__ import annotations

import logging
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from kvstore import KVCacheStore
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv, open_store
from tiers.disk.index import pack_entry, unpack_entry
from tiers.disk.tier import LMDBTier, bytes_per_block

CAPACITY_BLOCKS = 24  # the prompts below overflow it: stores evict
KEY_KINDS = ("key-short", "key-long", "key-prefix")
CASES = [
    *(("index", None, k) for k in (*KEY_KINDS, "value-short", "value-garbage", "value-slot", "value-size")),
    *(("order", None, k) for k in (*KEY_KINDS, "value-short", "value-garbage")),
    *(("free", None, k) for k in (*KEY_KINDS, "value-garbage", "key-size", "key-slot")),
    *(("log", None, k) for k in (*KEY_KINDS, "value-short", "value-garbage", "value-shape")),
    *(("meta", name, k) for name in (b"tick", b"used", b"seq") for k in ("value-short", "value-garbage", "missing")),
    *(("meta", b"hwm", k) for k in ("key-short", "key-long", "value-short", "value-garbage", "missing")),
    ("meta", b"leaked", "value-short"), ("meta", b"format", "value-garbage"), ("meta", b"ns:", "value-garbage"),
]


def _tokens(num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, size=num_blocks * BLOCK, dtype=np.uint32)


def _open(path: Path) -> KVCacheStore:
    return open_store(str(path), disk_bytes=CAPACITY_BLOCKS * bytes_per_block(LAYOUT.block_bytes(BLOCK)))


def _disk(store: KVCacheStore) -> LMDBTier:
    tier = store.tiers[-1]
    assert isinstance(tier, LMDBTier)
    return tier


def _store(store: KVCacheStore, tokens: np.ndarray) -> None:
    store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))


def _populate(path: Path) -> tuple[list[np.ndarray], bytes]:
    """Prompts held, free slots of both kinds (`u` and `p`), a log; the index key of a held
    block in the middle of a prompt."""
    with _open(path) as store:
        prompts = [_tokens(3, seed) for seed in range(5)]
        for tokens in prompts:
            _store(store, tokens)
        disk = _disk(store)
        disk.discard(store.block_hashes(prompts[0]))
        kept = [_tokens(1, 99), *prompts[2:]]
        _store(store, kept[0])  # reuses one freed slot, punches the other two (`p`)
        disk.discard(store.block_hashes(prompts[1]))  # three `u` slots
        loc = disk.payload_location(store.block_hashes(prompts[3])[1])
        assert loc is not None
        return kept, loc.index_key


def _records(txn: lmdb.Transaction, db: object) -> list[tuple[bytes, bytes]]:
    return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]


def _moved_key(key: bytes, kind: str) -> bytes:
    if kind == "key-short":
        return key[:-1]
    if kind == "key-long":
        return key + b"\x00"
    assert kind == "key-prefix"
    return bytes([key[0] ^ 0xFF]) + key[1:]


def _damage(path: Path, sub: str, name: bytes | None, kind: str, index_key: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    try:
        db = env.open_db(sub.encode(), create=False)
        with env.begin(write=True) as txn:
            records = _records(txn, db)
            if sub == "index":
                key = index_key
            elif sub == "order":
                key = records[0][0]  # the next to be evicted
            elif sub == "free":
                key = next(k for k, _ in records if k[:1] == b"u")
            elif sub == "log":
                key = records[-1][0]
            else:
                assert name is not None
                if name == b"leaked":  # (kept only after damage: a count of unnamed slots)
                    txn.put(name, b"\x01\x00\x00\x00\x00\x00\x00\x00", db=db)
                key = next(k for k, _ in _records(txn, db) if k.startswith(name))
            value = txn.get(key, db=db)
            assert value is not None
            value = bytes(value)
            if kind in KEY_KINDS or kind == "missing":
                txn.delete(key, db=db)
                if kind != "missing":
                    txn.put(_moved_key(key, kind), value, db=db)
                return
            if kind == "value-short":
                new = value[:-1]
            elif kind == "value-garbage":
                new = {"index": b"\xff" * len(value), "order": b"\x5a" * 24, "free": b"junk",
                       "log": b"\xc1\xc1\xc1"}.get(sub, b"\xff" * 8)
            elif kind == "value-shape":
                new = msgpack.packb({"removed": 1})
            elif kind in ("value-slot", "value-size"):
                e = unpack_entry(value)
                new = pack_entry(e._replace(slot=2**61) if kind == "value-slot" else e._replace(slot_bytes=12345))
            else:
                assert sub == "free" and kind in ("key-size", "key-slot")
                txn.delete(key, db=db)
                size, slot = key[1:9], key[9:]
                if kind == "key-size":
                    size = (12345).to_bytes(8, "big")
                else:
                    slot = (2**60).to_bytes(8, "big")
                txn.put(b"u" + size + slot, b"", db=db)
                return
            txn.put(key, new, db=db)
    finally:
        env.close()


def _check_hits(store: KVCacheStore, prompts: list[np.ndarray]) -> None:
    for tokens in prompts:
        res = store.retrieve(tokens)
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)  # exact bytes, whole blocks
        assert store.lookup(tokens) <= len(tokens)


@pytest.mark.parametrize(("sub", "name", "kind"), CASES,
                         ids=[f"{s}-{n.decode().rstrip(':') + '-' if n else ''}{k}" for s, n, k in CASES])
def test_damaged_index_record_is_counted_dropped_and_the_tier_goes_on(
        tmp_path: Path, sub: str, name: bytes | None, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    kept, index_key = _populate(tmp_path)
    _damage(tmp_path, sub, name, kind, index_key)
    stray = [tmp_path / "notes.txt", tmp_path / "slots-x.kvd"]
    for p in stray:
        p.write_bytes(b"not kvstrata's")
    caplog.set_level(logging.WARNING)
    with _open(tmp_path) as store:
        disk = _disk(store)
        _check_hits(store, kept)
        fresh = [_tokens(3, 100 + i) for i in range(5)]  # past the budget: evicts
        for tokens in fresh:
            _store(store, tokens)
        _check_hits(store, kept + fresh)
        assert store.retrieve(fresh[-1]).num_tokens == len(fresh[-1])
        store.scrub()
        num_corrupt = disk.stats().num_corrupt
        assert 1 <= num_corrupt <= 2, f"counted {num_corrupt} times"  # (a moved entry: its order record too)
        assert any("disk tier at" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
        assert store.scrub() == (len(disk), 0, 0)  # nothing damaged is left
        store.check_integrity()
        _check_hits(store, kept + fresh)
        _store(store, _tokens(3, 200))
        assert disk.stats().num_corrupt == num_corrupt  # counted once, not at every write
        store.clear()
        assert len(disk) == 0
        _store(store, fresh[0])
        _check_hits(store, [fresh[0]])
        assert store.retrieve(fresh[0]).num_tokens == len(fresh[0])
        store.check_integrity()
    with _open(tmp_path) as store:  # and it opens again, sound
        _check_hits(store, [fresh[0]])
        assert store.retrieve(fresh[0]).num_tokens == len(fresh[0])
        assert _disk(store).stats().num_corrupt == 0
        store.check_integrity()
    assert all(p.read_bytes() == b"not kvstrata's" for p in stray)


def test_a_damaged_change_log_record_makes_the_in_memory_index_rebuild(tmp_path: Path) -> None:
    """A log record (of another process's write) that does not decode: the in-memory index
    rebuilds from the index instead of replaying it, and the damage is counted."""
    with _open(tmp_path) as store:
        disk = _disk(store)
        tokens = _tokens(3, 1)
        _store(store, tokens)
        rebuilds = disk.index_syncs[0]
        ix = disk._ix
        with disk._env.begin(write=True) as txn:  # what another process's write would leave, damaged
            seq = ix.get_u64(txn, b"seq")
            txn.put((seq + 1).to_bytes(8, "big"), b"\xc1 not msgpack", db=ix.log)
            txn.put(b"seq", (seq + 1).to_bytes(8, "little"), db=ix.meta)
            txn.delete(disk._key(store.block_hashes(tokens)[2]), db=ix.index)  # the change it hides
        assert store.lookup(tokens) == 2 * BLOCK
        assert disk.index_syncs[0] == rebuilds + 1 and disk.stats().num_corrupt == 1
        res = store.retrieve(tokens)
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert res.num_tokens == 2 * BLOCK
        store.scrub()  # drops the record
        assert store.scrub() == (2, 0, 0)
        store.check_integrity()


@pytest.mark.parametrize("stray_len", [8, 24])
def test_a_damaged_index_key_of_another_valid_width_keeps_the_in_memory_index_compact(
        tmp_path: Path, stray_len: int) -> None:
    """An index key whose hash part is 8 or 24 bytes (not 16), sorting first in its namespace:
    the reopened tier's in-memory index took its width from it and held every real hash in
    the plain set, as large as before the compact set. Now the columns stay 16 bytes wide and
    every hit, the scrub and the integrity check are as with any other damaged key."""
    kept, index_key = _populate(tmp_path)
    tag = index_key[:-16]
    env = lmdb.open(str(tmp_path), max_dbs=8)
    try:
        db = env.open_db(b"index", create=False)
        with env.begin(write=True) as txn:
            value = txn.get(index_key, db=db)
            assert value is not None
            txn.put(tag + b"\x00" * stray_len, bytes(value), db=db)
    finally:
        env.close()
    with _open(tmp_path) as store:
        disk = _disk(store)
        assert disk._mirror.hashes.width == 16
        _check_hits(store, kept)
        assert all(store.lookup(tokens) == len(tokens) for tokens in kept)
        store.scrub()
        assert store.scrub() == (len(disk), 0, 0)
        store.check_integrity()
        _check_hits(store, kept)
