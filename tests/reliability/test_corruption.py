"""Corruption: damage records inside the LMDB file and check every one is a miss, then gone.

Two ways in, both worth testing: raw damage to data.mdb (bytes found by searching the file for
the record the tier wrote: flipped bits, a torn run of zeros, damaged magic or header) and
well-formed LMDB values with wrong contents (truncated, extended, empty, another key's record,
another layout's header, another prefix's token ids under a valid checksum). One block per
prompt is damaged; the prompt must then come back exactly up to that block, the record must
be deleted, the other prompts must be untouched, and the tier's invariants must hold.
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest
import torch

from kvstore import KVCacheStore, KVLayout
from tiers.base import BlockKey
from tiers.cpu import CPUTier
from tiers.lmdb import LMDBTier

from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, SMALL_BLOCK, SMALL_LAYOUT, check_kv, make_kv, open_store

RAW_KINDS = ("payload-bit", "header-byte", "magic-byte", "zero-run", "tail-zeroed")
VALUE_KINDS = ("truncated", "extended", "empty", "other-key", "other-layout", "other-tokens")
LAYOUTS = {"overflow-pages": (LAYOUT, BLOCK), "leaf-pages": (SMALL_LAYOUT, SMALL_BLOCK)}


def _disk(store: KVCacheStore) -> LMDBTier:
    tier = store.tiers[-1]
    assert isinstance(tier, LMDBTier)
    return tier


def _populate(path: Path, layout: KVLayout, block: int, num_prompts: int, seed: int):
    """Store `num_prompts` unrelated prompts of 2..5 blocks; return them and the open store."""
    rng = np.random.default_rng(seed)
    store = open_store(str(path), layout=layout, block_size=block)
    prompts = []
    for _ in range(num_prompts):
        tokens = rng.integers(0, 2**32, size=int(rng.integers(2, 6)) * block, dtype=np.uint32)
        assert store.store(tokens, make_kv(tokens, layout, block)) == len(tokens)
        prompts.append(tokens)
    return store, prompts


def _key_and_block(
    store: KVCacheStore, tokens: np.ndarray, index: int, layout: KVLayout, block: int
) -> tuple[BlockKey, torch.Tensor]:
    block_tokens = tokens[index * block : (index + 1) * block].tobytes()
    key = BlockKey(store.block_hashes(tokens)[index], block_tokens)
    kv = make_kv(tokens[: (index + 1) * block], layout, block)[:, :, index * block :]
    return key, kv.contiguous()


def _tampered_value(kind: str, record: bytes, other: bytes, tier: LMDBTier, key: BlockKey,
                    kv: torch.Tensor, rng: np.random.Generator) -> bytes:
    if kind == "truncated":
        return record[: int(rng.integers(1, len(record)))]
    if kind == "extended":
        return record + bytes(rng.integers(1, 64, dtype=np.uint8).item())
    if kind == "empty":
        return b""
    if kind == "other-key":
        return other
    hlen = int.from_bytes(record[4:8], "little")
    header = msgpack.unpackb(record[8 : 8 + hlen])
    if kind == "other-layout":
        header["dtype"] = "float32" if header["dtype"] != "float32" else "float16"
        packed = msgpack.packb(header, use_bin_type=True)
        return b"KVS1" + len(packed).to_bytes(4, "little") + packed + record[8 + hlen :]
    assert kind == "other-tokens"  # a colliding prefix: valid record, wrong token ids
    other_tokens = bytes(reversed(key.tokens))
    if other_tokens == key.tokens:
        other_tokens = b"\x01" * len(key.tokens)
    return bytes(tier.codec.encode(BlockKey(key.block_hash, other_tokens), kv))


def _damage_file(data: bytearray, record: bytes, kind: str, rng: np.random.Generator) -> None:
    """Damage `record` in the file image; copy-on-write leaves stale copies in free pages, so
    every copy gets the same damage (the live one among them)."""
    places = []
    at = data.find(record)
    while at >= 0:
        places.append(at)
        at = data.find(record, at + 1)
    assert places, "record not found in data.mdb"
    n, hlen = len(record), int.from_bytes(record[4:8], "little")
    if kind == "payload-bit":
        start = 8 + hlen + int(rng.integers(n - 8 - hlen))
        edit = bytes([record[start] ^ (1 << int(rng.integers(8)))])
    elif kind == "header-byte":
        start = 8 + int(rng.integers(hlen))
        edit = bytes([record[start] ^ int(rng.integers(1, 256))])
    elif kind == "magic-byte":
        start = int(rng.integers(8))
        edit = bytes([record[start] ^ int(rng.integers(1, 256))])
    else:  # zero-run: a torn sector somewhere; tail-zeroed: the end never reached the disk
        if kind == "zero-run":
            start = int(rng.integers(n - 16))
            end = min(n, start + int(rng.integers(16, 513)))
        else:
            start, end = n - int(rng.integers(1, min(n - 8, 2048))), n
        edit = bytes(end - start)
        if edit == record[start:end]:
            edit = b"\xff" + edit[1:]
    for at in places:
        data[at + start : at + start + len(edit)] = edit


def _check_after_damage(path: Path, layout: KVLayout, block: int, prompts: list[np.ndarray],
                        damaged: dict[int, int], via_scrub: bool) -> int:
    """Reopen; every damaged prompt stops before its damaged block, which is then gone."""
    store = open_store(str(path), layout=layout, block_size=block)
    try:
        disk = _disk(store)
        if via_scrub:
            result = disk.scrub()
            detected = result.num_corrupt
        for i, tokens in enumerate(prompts):
            res = store.retrieve(tokens)
            expected = damaged.get(i, len(tokens) // block) * block
            assert res.num_tokens == expected, (i, res.num_tokens, expected)
            check_kv(tokens, res.kv, res.num_tokens, layout, block)
            if i in damaged:
                h = store.block_hashes(tokens)[damaged[i]]
                assert disk.match_prefix([h]) == 0, "a damaged record was not deleted"
                assert store.lookup(tokens) == expected
        if not via_scrub:
            detected = disk.stats().num_corrupt
        assert disk.scrub().num_corrupt == 0
        store.check_integrity()
        return detected
    finally:
        store.close()


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_raw_file_damage_is_a_miss(tmp_path: Path, layout_name: str, figures: Figures) -> None:
    layout, block = LAYOUTS[layout_name]
    rng = np.random.default_rng([BUDGET.seed, 20, len(layout_name)])
    num_injected = num_detected = 0
    per_round = 10
    for r in range(-(-BUDGET.num_corruptions // per_round)):
        path = tmp_path / f"r{r}"
        store, prompts = _populate(path, layout, block, per_round + 4, int(rng.integers(2**31)))
        damaged: dict[int, int] = {}
        records: list[tuple[bytes, str]] = []
        for i in range(per_round):
            index = int(rng.integers(len(prompts[i]) // block))
            key, kv = _key_and_block(store, prompts[i], index, layout, block)
            kind = RAW_KINDS[(r + i) % len(RAW_KINDS)]
            records.append((bytes(_disk(store).codec.encode(key, kv)), kind))
            damaged[i] = index
        store.close()
        data_path = path / "data.mdb"
        data = bytearray(data_path.read_bytes())
        for record, kind in records:
            _damage_file(data, record, kind, rng)
        data_path.write_bytes(data)
        via_scrub = r % 2 == 1
        num_detected += _check_after_damage(path, layout, block, prompts, damaged, via_scrub)
        num_injected += len(damaged)
    assert num_detected == num_injected
    figures.set("injected", num_injected)
    figures.set("detected", num_detected)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_wrong_values_are_a_miss(tmp_path: Path, layout_name: str, figures: Figures) -> None:
    layout, block = LAYOUTS[layout_name]
    rng = np.random.default_rng([BUDGET.seed, 21, len(layout_name)])
    num_injected = num_detected = 0
    per_round = 12
    for r in range(-(-BUDGET.num_corruptions // per_round)):
        path = tmp_path / f"r{r}"
        store, prompts = _populate(path, layout, block, per_round + 4, int(rng.integers(2**31)))
        disk = _disk(store)
        damaged: dict[int, int] = {}
        values: dict[bytes, bytes] = {}
        for i in range(per_round):
            index = int(rng.integers(len(prompts[i]) // block))
            key, kv = _key_and_block(store, prompts[i], index, layout, block)
            okey, okv = _key_and_block(store, prompts[-1], 0, layout, block)
            record = bytes(disk.codec.encode(key, kv))
            kind = VALUE_KINDS[(r + i) % len(VALUE_KINDS)]
            other = bytes(disk.codec.encode(okey, okv))
            values[key.block_hash] = _tampered_value(kind, record, other, disk, key, kv, rng)
            damaged[i] = index
        store.close()
        with lmdb.open(str(path), max_dbs=4) as env:
            blocks = env.open_db(b"blocks")
            with env.begin(write=True, db=blocks) as txn:
                for h, value in values.items():
                    assert txn.get(h) is not None
                    txn.put(h, value)
        # Scrub cannot see a colliding prefix (it has no query tokens): only retrieval can.
        num_detected += _check_after_damage(path, layout, block, prompts, damaged, via_scrub=False)
        num_injected += len(damaged)
    assert num_detected == num_injected
    figures.set("injected", num_injected)
    figures.set("detected", num_detected)


def test_damage_under_a_running_store(tmp_path: Path, figures: Figures) -> None:
    """Bits flipped in data.mdb while a store has it mapped: the next read sees and drops them."""
    rng = np.random.default_rng([BUDGET.seed, 22])
    store, prompts = _populate(tmp_path, LAYOUT, BLOCK, 12, 5)
    try:
        disk = _disk(store)
        damaged = {}
        fd = os.open(tmp_path / "data.mdb", os.O_RDWR)
        try:
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            for i in range(8):
                index = int(rng.integers(len(prompts[i]) // BLOCK))
                key, kv = _key_and_block(store, prompts[i], index, LAYOUT, BLOCK)
                record = bytes(disk.codec.encode(key, kv))
                at = data.find(record)
                assert at >= 0
                pos = at + len(record) - 1 - int(rng.integers(LAYOUT.block_bytes(BLOCK)))
                os.pwrite(fd, bytes([data[pos] ^ 0x10]), pos)
                damaged[i] = index
        finally:
            os.close(fd)
        for i, tokens in enumerate(prompts):
            res = store.retrieve(tokens)
            assert res.num_tokens == damaged.get(i, len(tokens) // BLOCK) * BLOCK
            check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert disk.stats().num_corrupt == len(damaged)
        store.check_integrity()
        figures.set("injected", len(damaged))
        figures.set("detected", disk.stats().num_corrupt)
    finally:
        store.close()


@pytest.mark.parametrize("damage", ["bit-flip", "slots-swapped"])
def test_damaged_cpu_slots_are_a_miss(tmp_path: Path, damage: str, figures: Figures) -> None:
    """CPU slots damaged in memory (a flipped bit, or two slots' contents exchanged as a stale
    index would see them): with `cpu_checksums` each is a miss, dropped, and never demoted to
    the disk tier, which keeps serving its own good copy."""
    rng = np.random.default_rng([BUDGET.seed, 23, len(damage)])
    store = open_store(str(tmp_path), cpu_bytes=64 * LAYOUT.block_bytes(BLOCK), cpu_checksums=True)
    try:
        cpu = store.tiers[0]
        assert isinstance(cpu, CPUTier)
        prompts = [rng.integers(0, 2**32, size=3 * BLOCK, dtype=np.uint32) for _ in range(12)]
        for tokens in prompts:
            store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        damaged: dict[int, int] = {}
        for i in range(0, len(prompts), 2):
            index = int(rng.integers(3))
            view = cpu.block_view(store.block_hashes(prompts[i])[index])
            assert view is not None
            raw = view.view(torch.uint8).view(-1)
            if damage == "bit-flip":
                raw[int(rng.integers(raw.numel()))] ^= 1 << int(rng.integers(8))
            else:  # this prompt's block now holds the next prompt's block 0, and vice versa
                other = cpu.block_view(store.block_hashes(prompts[i + 1])[0])
                assert other is not None
                tmp = view.clone()
                view.copy_(other)
                other.copy_(tmp)
                damaged[i + 1] = 0
            damaged[i] = min(index, damaged.get(i, index))
        for i, tokens in enumerate(prompts):
            res = store.retrieve(tokens)
            assert res.num_tokens == damaged.get(i, 3) * BLOCK, (i, res.num_tokens)
            check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert cpu.stats().num_corrupt == len(damaged)
        store.check_integrity()
        # Blocks dropped from memory are not on disk either (no write-through): still misses.
        for i, tokens in enumerate(prompts):
            assert store.lookup(tokens) == damaged.get(i, 3) * BLOCK
        figures.set("injected", len(damaged))
        figures.set("detected", cpu.stats().num_corrupt)
    finally:
        store.close()
    # close() spilled the good blocks to disk, and none of the damaged ones.
    store = open_store(str(tmp_path))
    try:
        for i, tokens in enumerate(prompts):
            res = store.retrieve(tokens)
            assert res.num_tokens == damaged.get(i, 3) * BLOCK
            check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert _disk(store).scrub().num_corrupt == 0
    finally:
        store.close()
