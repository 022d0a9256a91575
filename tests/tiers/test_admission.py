"""Admission: the frequency sketch (pure, deterministic, never under the true count), the
admission rules, and the CPU tier's demotion admission through a real tier stack."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError
from kvstore.hashing import BlockHash
from kvstore.tier_stack import TierStack
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.cpu.tier import CPUTier
from tiers.disk.tier import LMDBTier
from tiers.keys import BlockKey
from tiers.policies.admission import (
    ADMISSION_RULES,
    Admission,
    AdmissionKind,
    AdmissionSpec,
    AdmitAll,
    AdmitSeen,
    AdmitTinyLFU,
    FrequencySketch,
    admission_rule,
    key_bits,
    parse_admission,
)

SHAPE = LAYOUT.block_shape(BLOCK)


def test_key_bits_golden_vectors() -> None:
    """The sketch's positions are the same in every process: splitmix64 for ints (its first
    output for seed 0 is the published 0xE220A8397B1DCDAF), the leading bytes of a digest."""
    assert key_bits(0) == 0xE220A8397B1DCDAF
    assert key_bits(1) == 0x910A2DEC89025CC1
    assert key_bits(b"\x01\x02\x03\x04\x05\x06\x07\x08rest") == 0x0807060504030201
    assert FrequencySketch(1000)._slots(0) == (431, 488, 545, 602)
    with pytest.raises(TypeError, match="bytes or int keys, not str"):
        key_bits("a")


def test_sketch_never_underestimates_until_it_halves() -> None:
    rng = random.Random(0)
    sketch = FrequencySketch(256, sample_x=100)  # no halving in this test
    true: dict[int, int] = {}
    for _ in range(5000):
        key = int(rng.paretovariate(1.2)) % 500
        sketch.add(key)
        true[key] = true.get(key, 0) + 1
    assert sketch.num_halvings == 0
    assert all(sketch.estimate(k) >= min(c, 15) for k, c in true.items())
    assert sum(sketch.estimate(k) == min(c, 15) for k, c in true.items()) > 0.8 * len(true)  # and is mostly exact


def test_sketch_halves_every_sample() -> None:
    sketch = FrequencySketch(16, sample_x=1)  # halves after 16 additions
    for _ in range(12):
        sketch.add(b"k" * 16)
    assert sketch.estimate(b"k" * 16) == 12
    for i in range(4):
        sketch.add(i)
    assert sketch.num_halvings == 1 and sketch.estimate(b"k" * 16) == 6


def test_parse_admission() -> None:
    assert parse_admission("seen:3") == AdmissionSpec(AdmissionKind.SEEN, 3)
    assert parse_admission(" ALL ") == AdmissionSpec() and str(parse_admission("tinylfu")) == "tinylfu"
    for bad in ("seen:1", "seen:16", "seen:x", "some", 3):
        with pytest.raises(ConfigError, match=r"x must be 'all', 'tinylfu' or 'seen:N' with N in \[2, 15\], got"):
            parse_admission(bad, "x")  # type: ignore[arg-type]


def test_admission_rules() -> None:
    seen = Admission("seen:2", 64)
    seen.record(1)
    assert not seen.admit(1)
    seen.record(1)
    assert seen.admit(1) and (seen.num_admitted, seen.num_refused) == (1, 1)
    tiny = Admission("tinylfu", 64)
    for key, uses in ((1, 3), (2, 1)):
        for _ in range(uses):
            tiny.record(key)
    assert tiny.admit(2) and tiny.admit(1, victim=2) and not tiny.admit(2, victim=1)
    every = Admission("all", 64)
    every.record(5)
    assert every.admits_all and every.admit(5, victim=1)


def key(i: int) -> BlockKey:
    return BlockKey(BlockHash(i.to_bytes(16, "little")), i.to_bytes(4, "little") * BLOCK)


def put(tier: CPUTier, ids: list[int]) -> None:
    tier.put([key(i) for i in ids], [torch.full(SHAPE, float(i), dtype=LAYOUT.dtype) for i in ids])


def test_cpu_tier_demotes_only_blocks_used_twice(tmp_path: Path) -> None:
    """With `seen:2`, blocks stored once and never read are dropped when evicted (the disk is
    spared their writes); blocks read again reach the disk, bit-exact."""
    disk = LMDBTier(str(tmp_path / "db"), 1 << 20, SHAPE, LAYOUT.dtype, sync=False)
    cpu = CPUTier(4, SHAPE, LAYOUT.dtype, demote_admission="seen:2")
    TierStack([cpu, disk], write_through=False)
    try:
        put(cpu, [1, 0])
        dst = [torch.empty(SHAPE, dtype=LAYOUT.dtype) for _ in range(2)]
        assert cpu.get_into([key(0), key(1)], dst) == 2  # blocks 0 and 1: a second use
        put(cpu, [3, 2])  # used once
        put(cpu, [7, 6, 5, 4])  # evicts the four above
        assert [disk.match_prefix([key(i).block_hash]) for i in range(4)] == [1, 1, 0, 0]
        assert cpu.num_demotions_refused == 2 and disk.stats().num_puts == 2
        assert disk.get_into([key(1)], dst[:1]) == 1 and torch.equal(dst[0], torch.full(SHAPE, 1.0, dtype=LAYOUT.dtype))
        cpu.check_integrity()
    finally:
        cpu.close()
        disk.close()


def test_store_config_admission_and_eviction_are_validated(tmp_path: Path) -> None:
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * LAYOUT.block_bytes(BLOCK), demote_admission="seen:2",
                      cpu_eviction="arc")
    assert cfg.demote_admission == AdmissionSpec(AdmissionKind.SEEN, 2) and cfg.cpu_eviction == "arc"
    with pytest.raises(ConfigError, match=r"StoreConfig\.demote_admission must be 'all' or 'seen:N'"):
        StoreConfig(LAYOUT, demote_admission="tinylfu")
    with pytest.raises(ConfigError, match=r"StoreConfig\.demote_admission must be 'all', 'tinylfu' or 'seen:N'"):
        StoreConfig(LAYOUT, demote_admission="seen:0")
    with pytest.raises(ConfigError, match=r"StoreConfig.cpu_eviction must be one of .*, got 'fifo'"):
        StoreConfig(LAYOUT, cpu_eviction="fifo")


def test_store_with_admission_spills_everything_on_close(tmp_path: Path) -> None:
    """Admission filters evictions only: closing a store still persists every CPU block."""
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=8 * LAYOUT.block_bytes(BLOCK), disk_path=str(tmp_path / "d"),
                      disk_sync=False, demote_admission="seen:3")
    tokens = list(range(4 * BLOCK))
    with KVCacheStore(cfg) as store:
        store.store(tokens, make_kv(len(tokens)))
    with KVCacheStore(cfg) as store:
        assert store.lookup(tokens) == len(tokens)


def test_each_rule_is_registered_with_a_config_of_its_own() -> None:
    assert ADMISSION_RULES.names() == ["all", "seen", "tinylfu"]
    assert admission_rule({"type": "seen", "threshold": 3}, "w") == AdmitSeen(3)
    assert admission_rule("seen:3") == AdmissionSpec(AdmissionKind.SEEN, 3)  # the string form still reads
    assert admission_rule("tinylfu").needs_victim and not admission_rule("all").counts_uses
    assert AdmitSeen(3).kind is AdmissionKind.SEEN and AdmissionSpec(AdmissionKind.SEEN, 3).rule == AdmitSeen(3)
    with pytest.raises(ConfigError, match=r"^w: AdmitSeen\.threshold must be an int in \[2, 15\], got 16$"):
        admission_rule({"type": "seen", "threshold": 16}, "w")
    with pytest.raises(ConfigError, match=r"^w must be 'all', 'tinylfu' or 'seen:N'"):
        admission_rule("seen:1", "w")


def test_a_rule_config_decides_as_its_string_did() -> None:
    keys = [bytes([i]) * 16 for i in range(4)]
    for spec, rule in ((AdmissionSpec(AdmissionKind.SEEN, 2), AdmitSeen(2)), (AdmissionSpec(), AdmitAll()),
                       (AdmissionSpec(AdmissionKind.TINYLFU), AdmitTinyLFU())):
        answers = []
        for r in (spec, rule):
            adm = Admission(r, 64)
            for k in keys[:2] * 2 + keys[2:3]:
                adm.record(k)
            answers.append([adm.admit(k, victim) for k in keys for victim in (None, keys[0], keys[3])])
        assert answers[0] == answers[1], spec


def test_the_cpu_tier_takes_a_rule_config() -> None:
    cpu = CPUTier(4, SHAPE, LAYOUT.dtype, demote_admission=AdmitSeen(2))
    try:
        assert cpu.num_demotions_refused == 0
    finally:
        cpu.close()
    with pytest.raises(ConfigError, match="'tinylfu' needs the lower tier's victim"):
        CPUTier(4, SHAPE, LAYOUT.dtype, demote_admission=AdmitTinyLFU())
