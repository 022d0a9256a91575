"""The connector's settings (no vLLM needed): its own keys, every library setting passed
through to each store's `StoreConfig` (keys generated from `StoreConfig`), `tiers`, the keys
it derives from vLLM refused, and what it derives for each store (`group_config`)."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.settings import CONNECTOR_DEFAULTS, DERIVED, ConnectorSettings, library_keys
from engine_adapter.vllm.store_config import Derived, group_config
from kvstore import ConfigError, HashAlgo, KVCacheStore, StoreConfig
from kvstore.load_policy import LoadPolicyMode
from tiers.codecs import CodecKind, Int8Config, RawConfig
from tiers.cpu.config import CPUTierConfig
from tiers.disk.config import DiskTierConfig
from tiers.disk.durability import DiskSync
from tiers.policies.admission import AdmissionKind, AdmissionSpec, AdmitSeen
from tiers.policies.eviction import EvictionKind
from tiers.policies.s3fifo import S3FIFOConfig
from tiers.remote.config import RemoteTierConfig

LAYOUT = opaque_layout(2, 1024, 4)  # as the connector's stores: one block of 2 layers, 1 KiB each
BLOCK = 4
BLOCK_BYTES = LAYOUT.block_bytes(BLOCK)
URL = "redis://127.0.0.1:1"
CPU = {"type": "cpu", "capacity_bytes": 64 * BLOCK_BYTES, "eviction": {"type": "s3fifo", "small_share": 0.2},
       "admission": {"type": "seen", "threshold": 3}, "tenant_quota_bytes": 16 * BLOCK_BYTES}

# One value for every library key, other than its default, and what `StoreConfig` makes of it
# (None: the value itself). A new `StoreConfig` field fails `test_every_library_setting_...`
# until it is either passed through (a sample here) or derived (`DERIVED`).
SAMPLES: dict[str, tuple[object, object]] = {
    "cpu_bytes": ("64KiB", 64 << 10),
    "disk_path": ("/var/kv", None),
    "disk_bytes": ("64MiB", 64 << 20),
    "hash_algo": ("sha256", HashAlgo.SHA256),
    "verify_tokens": (False, None),
    "disk_sync": ("group", DiskSync.GROUP),
    "write_through": (False, None),
    "persist_on_close": (False, None),
    "cpu_checksums": (True, None),
    "cpu_eviction": ("s3fifo", EvictionKind.S3FIFO),
    "demote_admission": ("seen:3", AdmissionSpec(AdmissionKind.SEEN, 3)),
    "cpu_tenant_quota_bytes": (16 * BLOCK_BYTES, None),
    "remote_url": (URL, None),
    "remote_ttl_s": (600, None),
    "remote_timeout_s": (2.5, None),
    "io_threads": (2, None),
    "result_buffer_bytes": (0, None),
    "load_policy": ("never", LoadPolicyMode.NEVER),
    "retain_share": ("0.25", 0.25),
    "disk_read_bps": ("50MiB", 50 << 20),
    "events_endpoint": ("tcp://127.0.0.1:5591", None),
    "events_replay_endpoint": ("tcp://127.0.0.1:5599", None),
    "events_topic": ("kv@pod@m", None),
    "events_curve_cert": ("/etc/kv/server.key_secret", None),
    "events_curve_clients": ("/etc/kv/clients", None),
    "events_insecure": (True, None),
    "events_connect": (True, None),
    "instance_id": ("engine-7", None),
    "disk_codec": ("int8", CodecKind.INT8),
    "remote_codec": ("zstd", CodecKind.ZSTD),
    "tiers": ([CPU, {"type": "disk", "path": "/var/kv", "capacity_bytes": 1 << 20}],
              (CPUTierConfig(64 * BLOCK_BYTES, eviction=S3FIFOConfig(small_share=0.2), admission=AdmitSeen(3),
                             tenant_quota_bytes=16 * BLOCK_BYTES),
               DiskTierConfig("/var/kv", 1 << 20, sync=DiskSync.NONE))),  # the connector's sync default
}


def derived(**kw: object) -> Derived:
    """An attention group's store, as `StorePlanner` derives it (head size 64, fp16 KV)."""
    values: dict[str, object] = {"layout": LAYOUT, "block_size": BLOCK, "namespace": '{"model": "m"}',
                                 "model_name": "m", "head_size": 64, "kv_dtype": torch.float16, **kw}
    return Derived(**values)  # type: ignore[arg-type]


def store_of(extra: dict[str, object], environ: dict[str, str] | None = None, **kw: object) -> StoreConfig:
    """The StoreConfig the connector builds for one store from `kv_connector_extra_config`."""
    return group_config(ConnectorSettings.from_sources(extra, environ or {}), derived(**kw))


def as_text(value: object) -> str:
    return json.dumps(value) if isinstance(value, list) else str(value)


def test_the_keys_are_the_connectors_own_and_every_store_config_field_but_the_derived() -> None:
    own = {f.name for f in ConnectorSettings.own_fields()}
    assert own == {"namespace", "stats_path", "async_saves", "async_loads", "metrics_port", "metrics_host",
                   "verify_fraction", "verify_tolerance", "control_endpoint", "control_token_file"}
    fields = {f.name for f in dataclasses.fields(StoreConfig)}
    assert set(library_keys()) == fields - set(DERIVED) - {"namespace"}  # namespace: derived, plus the user's text
    assert set(ConnectorSettings.keys()) == own | set(library_keys())
    assert set(SAMPLES) == set(library_keys()), "give the new StoreConfig field a sample (or derive it)"


@pytest.mark.parametrize("source", ["extra_config", "environment"])
@pytest.mark.parametrize("key", library_keys())
def test_every_library_setting_reaches_the_store_config(key: str, source: str) -> None:
    given, expected = SAMPLES[key]
    default = next(f.default for f in dataclasses.fields(StoreConfig) if f.name == key)
    if source == "extra_config":
        config = store_of({key: given})
    else:
        config = store_of({}, {f"KVSTRATA_{key.upper()}": as_text(given)})
    value = getattr(config, key)
    assert value == (given if expected is None else expected), (key, value)
    assert value != CONNECTOR_DEFAULTS.get(key, (default,))[0], key  # the sample is not the default


def test_eviction_admission_quotas_and_the_remote_bounds_are_settable_from_vllm(tmp_path: Path) -> None:
    """What the docs advise and the connector once refused: flat, and as tier configs."""
    flat = store_of({"cpu_eviction": "arc", "demote_admission": "seen:4", "cpu_tenant_quota_bytes": "32KiB",
                     "remote_url": URL, "remote_ttl_s": 3600, "remote_timeout_s": "1.5"})
    cpu, remote = flat.tier_configs
    assert isinstance(cpu, CPUTierConfig) and cpu.eviction.name == "arc"  # type: ignore[attr-defined]
    assert str(cpu.admission) == "seen:4" and cpu.tenant_quota_bytes == 32 << 10
    assert isinstance(remote, RemoteTierConfig) and (remote.ttl_s, remote.timeout_s) == (3600, 1.5)
    remote_tier = {"type": "remote", "url": URL, "ttl_s": 60, "timeout_s": 2, "clear_budget_s": 5,
                   "max_pending_bytes": 1 << 20, "cooldown_s": 1, "min_rate_bps": 1 << 20}
    tiers = store_of({"tiers": [CPU, {"type": "disk", "path": str(tmp_path / "kv"), "sync": "commit"},
                                remote_tier]}).tier_configs
    cpu, disk, remote = tiers
    assert isinstance(cpu, CPUTierConfig) and cpu.eviction == S3FIFOConfig(small_share=0.2)
    assert cpu.admission == AdmitSeen(3) and cpu.tenant_quota_bytes == 16 * BLOCK_BYTES
    assert isinstance(disk, DiskTierConfig) and disk.sync is DiskSync.COMMIT  # given: not the connector's default
    assert isinstance(remote, RemoteTierConfig)
    assert (remote.ttl_s, remote.timeout_s, remote.clear_budget_s, remote.max_pending_bytes, remote.cooldown_s,
            remote.min_rate_bps) == (60, 2.0, 5.0, 1 << 20, 1.0, float(1 << 20))
    with KVCacheStore(store_of({"tiers": [CPU, {"type": "disk", "path": str(tmp_path / "kv")}]})) as store:
        assert [t.kind.value for t in store.tiers] == ["cpu", "disk"]


def test_the_keys_the_connector_derives_are_refused_saying_why() -> None:
    for key, why in [("block_size", "vLLM's block size"), ("layout", "vLLM's KV cache spec"),
                     ("model_name", "served model name"), ("codec_group", "head size"),
                     ("pool_blocks", "vLLM keeps the engine's paged KV itself")]:
        with pytest.raises(ConfigError, match=rf"^kv_connector_extra_config keys: '{key}' cannot be set: .*{why}"):
            ConnectorSettings.from_sources({key: 16}, {})
    with pytest.raises(ConfigError, match=r"KVSTRATA_BLOCK_SIZE: it is vLLM's block size"):
        ConnectorSettings.from_sources({}, {"KVSTRATA_BLOCK_SIZE": "16"})
    with pytest.raises(ConfigError, match=r"^tiers\[0\]: a 'pool' tier holds an engine's paged KV: vLLM keeps"):
        ConnectorSettings.from_sources({"tiers": [{"type": "pool", "num_blocks": 4}, CPU]}, {})


def test_an_unknown_key_is_one_error_naming_it_and_its_close_matches() -> None:
    with pytest.raises(ConfigError) as exc:
        ConnectorSettings.from_sources({"cpu_evict": "lru", "remote_tll_s": 5}, {})
    message = str(exc.value)
    assert message.startswith("unknown kv_connector_extra_config keys ['cpu_evict', 'remote_tll_s']")
    assert "'cpu_evict': did you mean 'cpu_eviction'?" in message
    assert "'remote_tll_s': did you mean 'remote_ttl_s'" in message and "\n" not in message


def test_library_values_are_checked_by_the_librarys_own_configs() -> None:
    for extra, message in [
        ({"cpu_eviction": "fifo9"}, r"StoreConfig\.cpu_eviction must be one of \['lru', 's3fifo', 'arc', 'lfu'\]"),
        ({"remote_url": URL, "remote_timeout_s": 100}, r"StoreConfig\.remote_timeout_s must be in \(0, 60\]"),
        ({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20, "eviction": "fifo9"}]},
         r"^tiers\[0\]: CPUTierConfig\.eviction='fifo9' is not a registered eviction policy"),
        ({"tiers": [{"type": "tape"}]}, r"^tiers\[0\]\.type='tape' is not a registered tier"),
        ({"tiers": [CPU], "cpu_bytes": "1GiB"}, r"^tiers is given, and so are the flat tier fields \['cpu_bytes'\]"),
        ({"tiers": "[{"}, r"^tiers must be a list of tier configs \(JSON\)"),
        ({"cpu_bytes": "lots"}, r"^cpu_bytes must be a byte count such as"),
        ({"cpu_bytes": 0}, r"StoreConfig enables no tier"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ConnectorSettings.from_sources(extra, {})


def test_the_connectors_defaults_differ_from_the_librarys_in_one_place_each_saying_why() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(StoreConfig)}
    assert sorted(CONNECTOR_DEFAULTS) == ["disk_sync", "write_through"]
    for name, ours in CONNECTOR_DEFAULTS.items():
        assert ours.value != defaults[name] and len(ours.why) > 20, name
        assert "Default here" in dict((s.name, s.described) for s in ConnectorSettings.settings())[name]
    assert ConnectorSettings.own_fields()[0].default == "" != defaults["namespace"]  # the user's part of it only
    config = store_of({"disk_path": "/var/kv"})
    assert config.write_through is True and config.disk_sync is DiskSync.NONE
    # beside `tiers` the flat disk_sync keeps its default; a disk tier given as a dict takes the connector's
    config = store_of({"tiers": [{"type": "disk", "path": "/var/kv"}]})
    assert config.disk_sync is DiskSync.COMMIT and config.tier_configs[0].sync is DiskSync.NONE  # type: ignore[attr-defined]


def test_each_store_gets_its_share_of_the_memory_tiers_and_views_none() -> None:
    flat = ConnectorSettings.from_sources({"cpu_bytes": 64 * BLOCK_BYTES, "cpu_tenant_quota_bytes": 16 * BLOCK_BYTES,
                                           "disk_path": "/var/kv"}, {})
    quarter = group_config(flat, derived(memory_share=Fraction(1, 4)))
    assert (quarter.cpu_bytes, quarter.cpu_tenant_quota_bytes) == (16 * BLOCK_BYTES, 4 * BLOCK_BYTES)
    view = group_config(flat, derived(memory_share=Fraction(0), saves=False, publishes=False))
    assert [t.tier.kind.value for t in view.tier_configs] == ["disk"] and view.write_through is False
    tiers = ConnectorSettings.from_sources({"tiers": [CPU, {"type": "disk", "path": "/var/kv"}]}, {})
    cpu = group_config(tiers, derived(memory_share=Fraction(1, 4))).tier_configs[0]
    assert isinstance(cpu, CPUTierConfig) and (cpu.capacity_bytes, cpu.tenant_quota_bytes) == (
        16 * BLOCK_BYTES, 4 * BLOCK_BYTES)
    assert cpu.eviction == S3FIFOConfig(small_share=0.2)  # the rest as given
    view = group_config(tiers, derived(memory_share=Fraction(0), saves=False))
    assert [t.tier.kind.value for t in view.tier_configs] == ["disk"]
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.tenant_quota_bytes=\d+ leaves KV cache group 1 less than one "
                                          r"block"):
        group_config(tiers, derived(memory_share=Fraction(1, 32), what="KV cache group 1"))


def test_a_state_group_keeps_exact_bytes_and_an_attention_group_quantizes_per_head() -> None:
    for extra in ({"cpu_bytes": 0, "disk_path": "/var/kv", "disk_codec": "int8", "remote_url": URL,
                   "remote_codec": "zstd"},
                  {"tiers": [{"type": "disk", "path": "/var/kv", "codec": "int8"},
                             {"type": "remote", "url": URL, "codec": "zstd"}]}):
        attention = store_of(extra)
        assert [t.codec.kind for t in attention.tier_configs] == [CodecKind.INT8, CodecKind.ZSTD]  # type: ignore[union-attr]
        assert attention.tier_configs[0].codec == Int8Config()
        assert (attention.codec_dtype, attention.codec_group, attention.lossy_codecs) == (torch.float16, 64, ["int8"])
        state = store_of(extra, head_size=None, kv_dtype=None)
        assert state.tier_configs[0].codec == RawConfig() and state.lossy_codecs == []
        assert state.tier_configs[1].codec.kind is CodecKind.ZSTD  # type: ignore[union-attr]  # lossless: kept


def test_events_only_where_the_store_publishes_and_write_through_only_where_it_saves() -> None:
    extra = {"disk_path": "/var/kv", "events_endpoint": "tcp://127.0.0.1:5591", "events_topic": "t"}
    assert store_of(extra).events_endpoint == "tcp://127.0.0.1:5591"
    quiet = store_of(extra, publishes=False, saves=False)
    assert (quiet.events_endpoint, quiet.events_topic, quiet.write_through) == (None, "t", False)


def test_the_disk_directory_is_the_flat_disk_path_or_the_disk_tiers() -> None:
    assert ConnectorSettings.from_sources({"disk_path": "/a"}, {}).disk_dir == "/a"
    tiers = [{"type": "cpu", "capacity_bytes": 1 << 20}, {"type": "disk", "path": "/b"}]
    assert ConnectorSettings.from_sources({"tiers": tiers}, {}).disk_dir == "/b"
    assert ConnectorSettings.from_sources({"remote_url": URL}, {}).disk_dir is None  # shared, not a directory


def test_a_password_in_the_tiers_is_never_shown() -> None:
    url = "redis://:s3cret-pw@127.0.0.1:1"
    with pytest.raises(ConfigError) as bad_json:
        ConnectorSettings.from_sources({}, {"KVSTRATA_TIERS": f'[{{"type": "remote", "url": "{url}"'})
    with pytest.raises(ConfigError) as bad_url:
        ConnectorSettings.from_sources({"tiers": [{"type": "remote", "url": url + "/x/y"}]}, {})
    settings = ConnectorSettings.from_sources({"tiers": [{"type": "remote", "url": url}]}, {})
    for shown in (str(bad_json.value), str(bad_url.value), repr(settings), repr(group_config(settings, derived()))):
        assert "s3cret-pw" not in shown, shown


def test_control_endpoint_is_host_port_and_loopback_unless_a_token_file_is_given() -> None:
    assert ConnectorSettings.from_sources({"control_endpoint": "127.0.0.1:8200"}).control_endpoint == "127.0.0.1:8200"
    for bad in ("8200", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", "host name:80", ":80", 8200):
        with pytest.raises(ConfigError, match="control_endpoint"):
            ConnectorSettings.from_sources({"control_endpoint": bad})
    with pytest.raises(ConfigError, match="reachable from other hosts: give control_token_file"):
        ConnectorSettings.from_sources({"control_endpoint": "0.0.0.0:8200"})
    given = ConnectorSettings.from_sources({"control_endpoint": "[::]:8200", "control_token_file": "/run/token"})
    assert given.control_token_file == "/run/token"


@pytest.mark.parametrize("bad", ["nan", float("nan"), -0.01, "-1", 1.5, "inf", "lots", True])
def test_a_bad_verify_tolerance_or_fraction_is_one_error_naming_it(bad: object) -> None:
    for key in ("verify_tolerance", "verify_fraction"):
        with pytest.raises(ConfigError, match=rf"^{key} must be a finite number in \[0, 1\], got "):
            ConnectorSettings.from_sources({key: bad}, {})
    assert ConnectorSettings.from_sources({"verify_tolerance": "0.01"}, {}).verify_tolerance == 0.01
    assert ConnectorSettings.from_sources({}, {}).verify_tolerance == 0.0  # exact by default
