"""Corruption: damage blocks on disk and check every one is a miss, then gone.

Two ways in, both worth testing: raw damage to the files (a payload's bytes in its slot file:
a flipped bit, a torn run of zeros, a tail that never reached the device; an index entry's
bytes inside data.mdb: its checksum, the slot it names, a token id) and well-formed index
values with wrong contents written through LMDB (truncated, extended, empty, another key's
entry, another layout's, another prefix's token ids under a valid checksum). One block per
prompt is damaged; the prompt must then come back exactly up to that block, the block must be
deleted, the other prompts must be untouched, and the tier's invariants must hold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVCacheStore, KVLayout
from tiers.cpu.tier import CPUTier
from tiers.disk.index import pack_entry
from tiers.disk.tier import LMDBTier, PayloadLocation

from . import diskdamage
from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT, SMALL_BLOCK, SMALL_LAYOUT, check_kv, make_kv, open_store

RAW_KINDS = ("payload-bit", "entry-checksum", "entry-slot", "zero-run", "tail-zeroed", "entry-tokens")
VALUE_KINDS = ("truncated", "extended", "empty", "other-key", "other-layout", "other-tokens")
# 4 KiB payloads fill page-sized slots; 256-byte ones share pages with their neighbours.
LAYOUTS = {"page-slots": (LAYOUT, BLOCK), "small-slots": (SMALL_LAYOUT, SMALL_BLOCK)}


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


def _location(store: KVCacheStore, tokens: np.ndarray, index: int) -> PayloadLocation:
    loc = _disk(store).payload_location(store.block_hashes(tokens)[index])
    assert loc is not None
    return loc


def _tampered_value(kind: str, path: Path, loc: PayloadLocation, other: PayloadLocation, block: int,
                    rng: np.random.Generator) -> bytes:
    entry = diskdamage.read_entry(path, loc.index_key)
    raw = pack_entry(entry)
    if kind == "truncated":
        return raw[: int(rng.integers(1, len(raw)))]
    if kind == "extended":
        return raw + bytes(rng.integers(1, 64, dtype=np.uint8).item())
    if kind == "empty":
        return b""
    if kind == "other-key":
        return pack_entry(diskdamage.read_entry(path, other.index_key))
    if kind == "other-layout":
        return pack_entry(entry._replace(layout=entry.layout ^ 1))
    assert kind == "other-tokens"  # a colliding prefix: sound entry, wrong token ids
    other_tokens = bytes(reversed(entry.tokens))
    if other_tokens == entry.tokens:
        other_tokens = b"\x01" * len(entry.tokens)
    return diskdamage.entry_with_tokens(path, loc, other_tokens)


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
        targets: list[tuple[PayloadLocation, str]] = []
        for i in range(per_round):
            index = int(rng.integers(len(prompts[i]) // block))
            targets.append((_location(store, prompts[i], index), RAW_KINDS[(r + i) % len(RAW_KINDS)]))
            damaged[i] = index
        store.close()
        for loc, kind in targets:
            if kind.startswith("entry-"):
                diskdamage.damage_entry_in_file(path, loc.index_key, kind, rng)
            else:
                diskdamage.damage_payload(loc, kind, rng)
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
        damaged: dict[int, int] = {}
        targets: list[tuple[PayloadLocation, str]] = []
        other = _location(store, prompts[-1], 0)
        for i in range(per_round):
            index = int(rng.integers(len(prompts[i]) // block))
            targets.append((_location(store, prompts[i], index), VALUE_KINDS[(r + i) % len(VALUE_KINDS)]))
            damaged[i] = index
        store.close()
        values = {loc.index_key: _tampered_value(kind, path, loc, other, block, rng) for loc, kind in targets}
        diskdamage.put_entries(path, values)
        # Scrub cannot see a colliding prefix (it has no query tokens): only retrieval can.
        num_detected += _check_after_damage(path, layout, block, prompts, damaged, via_scrub=False)
        num_injected += len(damaged)
    assert num_detected == num_injected
    figures.set("injected", num_injected)
    figures.set("detected", num_detected)


def test_damage_under_a_running_store(tmp_path: Path, figures: Figures) -> None:
    """Bits flipped in a slot file while a store has it open: the next read sees and drops them."""
    rng = np.random.default_rng([BUDGET.seed, 22])
    store, prompts = _populate(tmp_path, LAYOUT, BLOCK, 12, 5)
    try:
        disk = _disk(store)
        damaged = {}
        for i in range(8):
            index = int(rng.integers(len(prompts[i]) // BLOCK))
            diskdamage.damage_payload(_location(store, prompts[i], index), "payload-bit", rng)
            damaged[i] = index
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
