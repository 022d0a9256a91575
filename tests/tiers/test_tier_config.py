"""Tier configs: each built-in tier registered with a frozen config of its own, built from
plain JSON, validating its own fields, and opening its tier with a store's `TierContext`."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import BLOCK, LAYOUT
from tests.tiers.test_tier_contract import block, key
from tiers.base import Tier
from tiers.codecs import CodecKind, Int8Config
from tiers.cpu.config import CPUTierConfig
from tiers.disk.config import DiskTierConfig
from tiers.disk.durability import DiskSync
from tiers.disk.tier import LMDBTier
from tiers.errors import ConfigError
from tiers.keys import BlockHash, TierKind
from tiers.policies.admission import AdmitSeen
from tiers.policies.eviction import EVICTION_POLICIES, eviction_config
from tiers.policies.s3fifo import S3FIFOConfig
from tiers.pool.config import PoolTierConfig
from tiers.remote.config import RemoteTierConfig
from tiers.tier_config import TIERS, TierConfig, TierContext, register_tier, tier_config

SHAPE = LAYOUT.block_shape(BLOCK)
BLOCK_BYTES = LAYOUT.block_bytes(BLOCK)


def context(**kw: object) -> TierContext:
    return TierContext(SHAPE, LAYOUT.dtype, BlockHash(b"s" * 16), **kw)  # type: ignore[arg-type]


def test_the_built_in_tiers_are_registered_fastest_first() -> None:
    assert TIERS.names()[:4] == ["pool", "cpu", "disk", "remote"]
    assert [e.config.tier.kind for e in TIERS.entries()[:4]] == [TierKind.POOL, TierKind.CPU, TierKind.DISK,
                                                                 TierKind.REMOTE]


def test_tier_configs_from_plain_json(tmp_path: Path) -> None:
    text = json.dumps([
        {"type": "pool", "num_blocks": 8, "device": "cpu", "demotion": "write_through"},
        {"type": "cpu", "capacity_bytes": 1 << 20, "checksums": True, "admission": "seen:2",
         "eviction": {"type": "s3fifo", "small_share": 0.25}, "tenant_quota_bytes": 1 << 16},
        {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 26, "sync": "group", "codec": "int8"},
        {"type": "RemoteTier", "url": "redis://127.0.0.1:1", "ttl_s": 60, "codec": {"type": "zstd"}},
    ])
    pool, cpu, disk, remote = (tier_config(v, f"t[{i}]") for i, v in enumerate(json.loads(text)))
    assert isinstance(pool, PoolTierConfig) and pool.demotion.value == "write_through"
    assert isinstance(cpu, CPUTierConfig) and cpu.eviction == S3FIFOConfig(small_share=0.25)
    assert cpu.admission.kind == "seen" and str(cpu.admission) == "seen:2" and cpu.codec is None
    assert disk == DiskTierConfig(str(tmp_path), 1 << 26, DiskSync.GROUP, None, Int8Config())
    assert isinstance(remote, RemoteTierConfig) and remote.codec.kind is CodecKind.ZSTD
    assert "127.0.0.1" not in repr(remote)  # a URL may hold a password: never shown


@pytest.mark.parametrize(("value", "message"), [
    ({"type": "cpu"}, r"^t: tier 'cpu' needs \['capacity_bytes'\]$"),
    ({"type": "cpu", "capacity_bytes": 0}, r"^t: CPUTierConfig\.capacity_bytes must be an int > 0, got 0$"),
    ({"type": "cpu", "capacity_bytes": 1, "eviction": "fifo2"},
     r"^t: CPUTierConfig\.eviction='fifo2' is not a registered eviction policy"),
    ({"type": "cpu", "capacity_bytes": 1, "admission": "tinylfu"},
     r"^t: CPUTierConfig\.admission must be 'all' or 'seen:N'; 'tinylfu' compares with the lower tier's victim"),
    ({"type": "cpu", "capacity_bytes": 1, "admission": {"type": "seen", "threshold": 1}},
     r"^t: CPUTierConfig\.admission: AdmitSeen\.threshold must be an int in \[2, 15\], got 1$"),
    ({"type": "disk", "path": ""}, r"^t: DiskTierConfig\.path must be a non-empty path without NUL bytes, got ''$"),
    ({"type": "disk", "path": "/x", "capacity_bytes": 1 << 45},
     r"^t: DiskTierConfig\.capacity_bytes must be an int in \[1, 17592186044416\], got"),
    ({"type": "disk", "path": "/x", "codec": "int3"}, r"^t: DiskTierConfig\.codec='int3' is not a registered codec"),
    ({"type": "disk", "path": "/x", "sync": "sometimes"}, r"^t: DiskTierConfig\.sync must be a bool or one of"),
    ({"type": "remote", "url": "http://x"}, r"^t: .*redis"),
    ({"type": "remote", "url": "redis://h:1", "timeout_s": 0}, r"^t: RemoteTierConfig\.timeout_s must be in \(0, 60\]"),
    ({"type": "remote", "url": "redis://h:1", "max_pending_bytes": 0},
     r"^t: RemoteTierConfig\.max_pending_bytes must be an int > 0, got 0$"),
    ({"type": "remote", "url": "redis://h:1", "cooldown_s": -1},
     r"^t: RemoteTierConfig\.cooldown_s must be in \(0, 3600\] seconds, got -1$"),
    ({"type": "remote", "url": "redis://h:1", "min_rate_bps": 1000},
     r"^t: RemoteTierConfig\.min_rate_bps must be in \[1024, 1099511627776\] bytes per second, got 1000$"),
    ({"type": "remote", "url": "redis://h:1", "clear_budget_s": float("inf")},
     r"^t: RemoteTierConfig\.clear_budget_s must be in \(0, 86400\] seconds, got inf$"),
    ({"type": "remote", "url": "redis://h:1", "connections_per_node": 0},
     r"^t: RemoteTierConfig\.connections_per_node must be an int in \[1, 64\], got 0$"),
    ({"type": "remote", "url": "redis://h:1", "connections_per_node": 65},
     r"^t: RemoteTierConfig\.connections_per_node must be an int in \[1, 64\], got 65$"),
    ({"type": "remote", "url": "redis://h:1", "connections_per_node": 2.0},
     r"^t: RemoteTierConfig\.connections_per_node must be an int in \[1, 64\], got 2\.0$"),
    ({"type": "pool", "num_blocks": 4, "device": "meta"}, r"^t: PoolTierConfig\.device='meta' is not a device"),
    ({"type": "pool", "num_blocks": 4, "demotion": "never"}, r"^t: PoolTierConfig\.demotion must be 'on_evict' or"),
    ({"type": "tape", "capacity_bytes": 1}, r"^t\.type='tape' is not a registered tier; registered: \['pool', 'cpu'"),
    ({"type": "cpu", "capacity_bytes": 1, "size": 2}, r"^t: tier 'cpu' has no field 'size' \(given 2\); its fields"),
])
def test_a_bad_tier_config_is_one_error_naming_it(value: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tier_config(value, "t")


def test_a_tier_checks_it_holds_a_block() -> None:
    with pytest.raises(ConfigError, match=rf"^x\.capacity_bytes=10 holds no block of {BLOCK_BYTES} bytes$"):
        CPUTierConfig(10).check(BLOCK_BYTES, "x")
    with pytest.raises(ConfigError, match=rf"^x\.tenant_quota_bytes=10 holds no block of {BLOCK_BYTES} bytes$"):
        CPUTierConfig(1 << 20, tenant_quota_bytes=10).check(BLOCK_BYTES, "x")
    with pytest.raises(ConfigError, match=r"^x\.capacity_bytes=100 is below two blocks"):
        DiskTierConfig("/x", 100).check(BLOCK_BYTES, "x")
    CPUTierConfig(BLOCK_BYTES).check(BLOCK_BYTES, "x")


def test_each_config_opens_its_tier(tmp_path: Path) -> None:
    cpu = CPUTierConfig(3 * BLOCK_BYTES + 1, eviction="lfu", admission=AdmitSeen(3)).open(context())
    try:
        assert cpu.kind is TierKind.CPU and cpu.capacity_blocks == 3
        assert cpu.put([key(1)], [block(1)]) == 1
    finally:
        cpu.close()
    pool = PoolTierConfig(4, device="cpu").open(context())
    try:
        assert pool.kind is TierKind.POOL and pool.capacity_blocks == 4
    finally:
        pool.close()
    ctx = context(codec_dtype=None, accepted_codecs=frozenset({CodecKind.INT8}))
    disk = DiskTierConfig(str(tmp_path / "d"), 64 << 20, sync=False, codec="int8").open(ctx)  # type: ignore[arg-type]
    try:
        assert isinstance(disk, LMDBTier) and disk.put([key(2)], [block(2)]) == 1
        location = disk.payload_location(key(2).block_hash)
        assert location is not None and location.codec_id == CodecKind.INT8.value
        out = torch.empty(SHAPE, dtype=LAYOUT.dtype)
        assert disk.get_into([key(2)], [out]) == 1 and not torch.equal(out, block(2))  # lossy, but read back
        assert torch.allclose(out.float(), block(2).float(), atol=0.1, rtol=0.05)
    finally:
        disk.close()


def test_the_remote_tiers_knobs_reach_the_tier() -> None:
    """`max_pending_bytes`, `cooldown_s`, `min_rate_bps`, `clear_budget_s` and
    `connections_per_node` of the config are the opened tier's, against a real server."""
    from tests.redis_fixtures import redis_server

    with redis_server() as server:
        config = tier_config({"type": "remote", "url": server.url, "timeout_s": 2, "max_pending_bytes": 1 << 20,
                              "cooldown_s": 0.5, "min_rate_bps": 1 << 20, "clear_budget_s": 3,
                              "connections_per_node": 3}, "t")
        remote = config.open(context())
        try:
            assert remote.clear_budget_s == 3.0
            assert remote._server.limit(1 << 20) == pytest.approx(3.0)  # 2 s, and 1 MiB at 1 MiB/s
            assert remote._writes._max_pending_bytes == 1 << 20
            assert remote.reads._cooldown_s == 0.5
            assert remote._server.connections_per_node == 3 and remote._server._lanes.workers == 2
            assert remote.put([key(1)], [block(1)]) == 1 and remote.flush()
        finally:
            remote.close()


def test_a_tier_config_must_name_the_tier_it_opens() -> None:
    @dataclass(frozen=True)
    class Nameless(TierConfig):
        def open(self, ctx: TierContext) -> Tier:
            raise AssertionError("never opened")

    with pytest.raises(ConfigError, match=r"must name the Tier subclass it opens, with its kind and traits, as `tier`"):
        register_tier("nameless")(Nameless)
    assert "nameless" not in TIERS.names()


# The fields each built-in tier needs, so that one field at a time can be made hostile.
BASE = {"pool": {"num_blocks": 4}, "cpu": {"capacity_bytes": 1 << 20}, "disk": {"path": "/x"},
        "remote": {"url": "redis://127.0.0.1:1"}}
HOSTILE: list[object] = [
    float("inf"), float("nan"), -1, 0, 2**63, 2**64, 10**400, 2.5, 1.0, "", [], {}, None, True, False, (), b"1",
    object(), "Infinity", "NaN", "x\x00y", "\udcff", "x" * 5000, {"type": 3}, {"type": "lru", "x": 1},
    {"type": "none", "module_path": ""}, {"type": "x", "module_path": "os"},
]


@pytest.mark.parametrize("name", sorted(BASE))
def test_every_tier_field_takes_or_names_each_hostile_value(name: str) -> None:
    """Each value is taken (and then of a plain type its field's annotation names, or a config
    object) or refused with one `ConfigError` naming the field; never another exception."""
    fields = [f for f in dataclasses.fields(TIERS.get(name)) if f.init]
    for f in fields:
        for value in HOSTILE:
            try:
                made = tier_config({"type": name, **BASE[name], f.name: value}, "t")
            except ConfigError as exc:
                assert f.name in str(exc) and "\n" not in str(exc), (name, f.name, value, str(exc))
                continue
            taken = getattr(made, f.name)
            assert not isinstance(taken, float) or math.isfinite(taken), (name, f.name, value)
            assert taken is None or isinstance(taken, (bool, int, float, str, enum.Enum)) or \
                dataclasses.is_dataclass(taken), (name, f.name, value, taken)


@pytest.mark.parametrize("policy", ["s3fifo", "arc", "lfu"])
def test_every_policy_field_takes_or_names_each_hostile_value(policy: str) -> None:
    for f in dataclasses.fields(EVICTION_POLICIES.get(policy)):
        for value in HOSTILE:
            try:
                made = eviction_config({"type": policy, f.name: value}, "t")
            except ConfigError as exc:
                assert f.name in str(exc) and "\n" not in str(exc), (policy, f.name, value, str(exc))
                continue
            taken = getattr(made, f.name)
            assert isinstance(taken, float) and 0 < taken < 1e6, (policy, f.name, value, taken)


def test_a_device_string_with_control_characters_is_named_on_one_line() -> None:
    """torch's refusal quotes the string raw; the error names it by its repr, on one line."""
    for bad in ("\n", "cuda:\r0", "cpu\n\x0b"):
        with pytest.raises(ConfigError) as caught:
            PoolTierConfig(num_blocks=4, device=bad)
        assert "\n" not in str(caught.value) and "\r" not in str(caught.value) and repr(bad) in str(caught.value)
