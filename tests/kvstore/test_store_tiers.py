"""A store's tiers: the flat `StoreConfig` fields are sugar for a sequence of tier configs, and
the sequence given explicitly builds the same store; the sequence is checked as a whole."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVCacheStore, KVLayout, StoreConfig
from kvstore.errors import ConfigError
from tests.conftest import BLOCK, LAYOUT, POOL_DEVICE, make_kv
from tiers.codecs import Int8Config
from tiers.cpu.config import CPUTierConfig
from tiers.disk.config import DiskTierConfig
from tiers.pool.config import PoolTierConfig
from tiers.remote.config import RemoteTierConfig

BLOCK_BYTES = LAYOUT.block_bytes(BLOCK)


def flat_and_explicit(disk: Path) -> tuple[StoreConfig, StoreConfig]:
    """One store both ways: every built-in tier with non-default settings."""
    common: dict[str, Any] = {"layout": LAYOUT, "block_size": BLOCK, "namespace": "m", "verify_tokens": True}
    flat = StoreConfig(**common, pool_blocks=8, pool_device=POOL_DEVICE, pool_demotion="write_through",
                       cpu_bytes=6 * BLOCK_BYTES, cpu_checksums=True, cpu_eviction="s3fifo",  # type: ignore[arg-type]
                       demote_admission="seen:2", cpu_tenant_quota_bytes=4 * BLOCK_BYTES,  # type: ignore[arg-type]
                       disk_path=str(disk), disk_bytes=64 << 20, disk_sync="none", disk_read_bps=1 << 30,
                       disk_codec="int8")  # type: ignore[arg-type]
    explicit = StoreConfig(**common, tiers=[
        {"type": "pool", "num_blocks": 8, "device": POOL_DEVICE, "demotion": "write_through"},
        {"type": "cpu", "capacity_bytes": 6 * BLOCK_BYTES, "checksums": True, "eviction": "s3fifo",
         "admission": "seen:2", "tenant_quota_bytes": 4 * BLOCK_BYTES},
        {"type": "disk", "path": str(disk), "capacity_bytes": 64 << 20, "sync": "none", "read_bps": 1 << 30,
         "codec": {"type": "int8"}},
    ])
    return flat, explicit


def test_flat_fields_and_their_tiers_build_the_same_store(tmp_path: Path) -> None:
    flat, explicit = flat_and_explicit(tmp_path / "disk")
    assert flat.tiers == () and flat.tier_configs == explicit.tier_configs == explicit.tiers
    assert [type(t) for t in flat.tier_configs] == [PoolTierConfig, CPUTierConfig, DiskTierConfig]
    assert flat.identity() == explicit.identity() == ["m", 2, 2, 8, "float16", BLOCK, "xxh3_128",
                                                      ["lossy", ["int8"], None, None]]
    assert flat.lossy_codecs == explicit.lossy_codecs == ["int8"]
    tokens = list(range(12 * BLOCK))
    kv = make_kv(len(tokens), seed=5)
    seen = []
    for config in (flat, explicit):
        with KVCacheStore(config) as store:
            store.store(tokens, kv)
            located = store.locate(tokens)
            res = store.retrieve(tokens)
            seen.append((store.seed, [t.kind for t in store.tiers], located, res.num_tokens, res.kv))
            store.check_integrity()
    (seed_a, kinds_a, loc_a, n_a, kv_a), (seed_b, kinds_b, loc_b, n_b, kv_b) = seen
    assert seed_a == seed_b and kinds_a == kinds_b == ["pool", "cpu", "disk"] and loc_a == loc_b
    # (blocks used once are not admitted to the disk, "seen:2": the same prefix is left in both)
    assert n_a == n_b >= 6 * BLOCK and kv_a is not None and kv_b is not None and torch.equal(kv_a, kv_b)


def test_the_remote_tier_from_flat_fields() -> None:
    flat = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=0, remote_url="redis://127.0.0.1:6390/2", remote_ttl_s=60,
                       remote_timeout_s=2.0, remote_codec="zstd")  # type: ignore[arg-type]
    explicit = StoreConfig(LAYOUT, block_size=BLOCK, tiers=[
        {"type": "remote", "url": "redis://127.0.0.1:6390/2", "ttl_s": 60, "timeout_s": 2.0, "codec": "zstd"}])
    assert flat.tier_configs == explicit.tier_configs and isinstance(flat.tier_configs[0], RemoteTierConfig)
    assert flat.identity() == explicit.identity() == StoreConfig(LAYOUT, block_size=BLOCK).identity()  # lossless


def test_a_config_stays_a_value(tmp_path: Path) -> None:
    flat, explicit = flat_and_explicit(tmp_path / "disk")
    moved = dataclasses.replace(flat, disk_path=str(tmp_path / "other"))  # the flat fields build the tiers anew
    assert isinstance(moved.tier_configs[2], DiskTierConfig) and moved.tier_configs[2].path == str(tmp_path / "other")
    copy = pickle.loads(pickle.dumps(explicit))
    assert copy == explicit and hash(copy) == hash(explicit) and copy.tier_configs == explicit.tier_configs
    renamed = dataclasses.replace(explicit, namespace="n")
    assert renamed.tier_configs == explicit.tier_configs and renamed.identity()[0] == "n"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}], "disk_path": "/x"},
     r"StoreConfig\.tiers is given, and so are the flat tier fields \['disk_path'\]: give one or the other"),
    ({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}, {"type": "pool", "num_blocks": 4}]},
     r"^StoreConfig\.tiers\[1\]: a 'pool' tier holds the engine's paged KV; it must be the first tier$"),
    ({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}, {"type": "cpu", "capacity_bytes": 1 << 21}]},
     r"^StoreConfig\.tiers\[1\]: a second 'cpu' tier \(the first is StoreConfig\.tiers\[0\]\)$"),
    ({"tiers": [{"type": "cpu", "capacity_bytes": 10}]},
     rf"^StoreConfig\.tiers\[0\]\.capacity_bytes=10 holds no block of {BLOCK_BYTES} bytes$"),
    ({"tiers": [{"type": "disk", "path": "/x", "capacity_bytes": 100}]},
     r"^StoreConfig\.tiers\[0\]\.capacity_bytes=100 is below two blocks"),
    ({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20, "size": 1}]},
     r"^StoreConfig\.tiers\[0\]: tier 'cpu' has no field 'size'"),
    ({"tiers": ["cpu"]}, r"^StoreConfig\.tiers\[0\]: tier 'cpu' needs \['capacity_bytes'\]$"),
    ({"tiers": "cpu"}, r"^StoreConfig\.tiers must be a sequence of tier configs"),
    ({"tiers": 0}, r"^StoreConfig\.tiers must be a sequence of tier configs"),
    ({"tiers": [None]}, r"^StoreConfig\.tiers\[0\] must be a registered tier name, a dict"),
    ({"cpu_bytes": 0}, r"^StoreConfig enables no tier: set pool_blocks, cpu_bytes, disk_path or remote_url, or give"),
])
def test_the_sequence_is_checked_as_a_whole(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig(LAYOUT, block_size=BLOCK, **kwargs)


def test_each_tier_codec_is_opened_on_the_layout_and_named() -> None:
    opaque = KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"^StoreConfig\.tiers\[1\]\.codec='int8': the int8 codec quantizes"):
        StoreConfig(opaque, block_size=BLOCK, tiers=[CPUTierConfig(1 << 20), DiskTierConfig("/x", codec=Int8Config())])
    with pytest.raises(ConfigError, match=r"^StoreConfig\.disk_codec='int8': the int8 codec quantizes"):
        StoreConfig(opaque, block_size=BLOCK, disk_path="/x", disk_codec="int8")  # type: ignore[arg-type]
    ok = StoreConfig(opaque, block_size=BLOCK, codec_dtype=torch.bfloat16, codec_group=16,
                     tiers=[CPUTierConfig(1 << 20), DiskTierConfig("/x", codec=Int8Config())])
    assert ok.identity()[-1] == ["lossy", ["int8"], "bfloat16", 16]


def test_a_tier_config_whose_codec_is_not_a_codec_config_is_refused() -> None:
    @dataclass(frozen=True)
    class Sloppy(CPUTierConfig):  # takes a codec but leaves it as given
        @property
        def codec(self) -> Any:
            return "int8"

    with pytest.raises(ConfigError, match=r"^StoreConfig\.tiers\[0\]\.codec must be a codec config"):
        StoreConfig(LAYOUT, block_size=BLOCK, tiers=[Sloppy(1 << 20)])
