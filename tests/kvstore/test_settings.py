"""Settings from outside code, layer by layer: the library's, the connector's (what it passes
through to `StoreConfig`: tests/engine_adapter/vllm/test_settings.py), the tests' and the
benchmarks' variable families, and the table of docs/configuration.md."""

from __future__ import annotations

import pytest
import torch

from cli.settings import BenchSettings
from engine_adapter.vllm.settings import ConnectorSettings, parse_bytes
from kvstore import ConfigError, HashAlgo, KVLayout, StoreConfig
from kvstore.load_policy import LoadPolicy, LoadPolicyMode
from kvstore.settings import LibrarySettings, remote_password
from tests import ROOT
from tests.switches import Switches
from tiers.pool.gpu_pool import DemotionPolicy

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
LAYERS = (LibrarySettings, ConnectorSettings, Switches, BenchSettings)


def test_extra_config_wins_over_env_which_wins_over_defaults() -> None:
    env = {"KVSTRATA_CPU_BYTES": "2GiB", "KVSTRATA_DISK_PATH": "/env/kv", "KVSTRATA_HASH_ALGO": "sha256"}
    s = ConnectorSettings.from_sources({"disk_path": "/extra/kv", "write_through": "false"}, env)
    assert s.value("disk_path") == "/extra/kv"
    assert s.value("cpu_bytes") == 2 << 30
    assert s.value("hash_algo") is HashAlgo.SHA256
    assert s.write_through is False
    assert s.value("disk_bytes") == ConnectorSettings().value("disk_bytes") == StoreConfig.disk_bytes


def test_settings_reject_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config keys \['cpu_byte'\]; 'cpu_byte': did "
                                          r"you mean 'cpu_bytes'"):
        ConnectorSettings.from_sources({"cpu_byte": 1}, {})
    with pytest.raises(ConfigError, match="cpu_bytes must be a byte count"):
        ConnectorSettings.from_sources({}, {"KVSTRATA_CPU_BYTES": "lots"})
    with pytest.raises(ConfigError, match="disk_sync must be a bool"):
        ConnectorSettings.from_sources({"disk_sync": "maybe"}, {})
    with pytest.raises(ConfigError, match="enables no tier"):
        ConnectorSettings.from_sources({"cpu_bytes": 0}, {})
    with pytest.raises(ConfigError, match=r"load_policy must be one of \['auto', 'always', 'never'\], got 'sometimes'"):
        ConnectorSettings.from_sources({"load_policy": "sometimes"}, {})
    with pytest.raises(ConfigError, match="metrics_port"):
        ConnectorSettings.from_sources({"metrics_port": 70000}, {})


@pytest.mark.parametrize(
    ("text", "value"),
    [("1048576", 1 << 20), ("512MiB", 512 << 20), ("4G", 4 << 30), ("3 KiB", 3 << 10), (7, 7)],
)
def test_parse_bytes(text: object, value: int) -> None:
    assert parse_bytes("x", text) == value


def test_every_layers_table_in_the_docs_is_the_code() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for layer in LAYERS:
        assert layer.table() in doc, f"docs/configuration.md is out of date: regenerate {layer.__name__}'s table"
        assert all(f"| {s.name} |" in layer.table() and layer.PREFIX + s.name.upper() in layer.table()
                   for s in layer.settings())
    assert all(f"| {name} |" in ConnectorSettings.table() for name in ("tiers", "cpu_eviction", "remote_ttl_s"))


def test_each_variable_has_one_owner() -> None:
    owners: dict[str, str] = {}
    for layer in LAYERS:
        for variable in layer.variables():
            assert variable not in owners, (variable, owners.get(variable), layer.__name__)
            owners[variable] = layer.__name__
    assert owners["KVSTRATA_REMOTE_PASSWORD"] == "LibrarySettings"
    assert owners["KVSTRATA_TEST_REQUIRE_REDIS"] == "Switches"
    assert owners["KVSTRATA_TEST_POOL_DEVICE"] == "Switches"
    assert owners["KVSTRATA_BENCH_RESULTS"] == "BenchSettings"


def test_unknown_variables_are_refused_by_their_owner_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"KVSTRATA_CPU_BYTE\b.*KVSTRATA_CPU_BYTES"):
        ConnectorSettings.from_sources({}, {"KVSTRATA_CPU_BYTE": "1G"})
    # the connector knows the library's variables and leaves the other families to their owners
    s = ConnectorSettings.from_sources({"metrics_port": "9400"}, {
        "KVSTRATA_EVENTS_ENDPOINT": "tcp://127.0.0.1:5557", "KVSTRATA_REMOTE_PASSWORD": "s3cret",
        "KVSTRATA_TEST_REQUIRE_REDIS_": "1", "KVSTRATA_BENCH_RESULT": "x"})
    assert s.metrics_port == 9400 and s.value("events_endpoint") == "tcp://127.0.0.1:5557"
    with pytest.raises(ConfigError, match=r"KVSTRATA_TEST_REQUIRE_REDIS_.*KVSTRATA_TEST_REQUIRE_REDIS"):
        Switches.from_sources(None, {"KVSTRATA_TEST_REQUIRE_REDIS_": "1", "KVSTRATA_CPU_BYTE": "1G"})
    with pytest.raises(ConfigError, match=r"KVSTRATA_BENCH_RESULT\b.*KVSTRATA_BENCH_RESULTS"):
        BenchSettings.from_sources(None, {"KVSTRATA_BENCH_RESULT": "x"})
    # a variable that moved to a family is refused naming its new name
    with pytest.raises(ConfigError, match="KVSTRATA_REQUIRE_REDIS is now KVSTRATA_TEST_REQUIRE_REDIS"):
        ConnectorSettings.from_sources({}, {"KVSTRATA_REQUIRE_REDIS": "1"})
    with pytest.raises(ConfigError, match="KVSTRATA_RESULTS is now KVSTRATA_BENCH_RESULTS"):
        ConnectorSettings.from_sources({}, {"KVSTRATA_RESULTS": "x"})


def test_switches_parse_their_family() -> None:
    s = Switches.from_sources(None, {"KVSTRATA_TEST_REQUIRE_REDIS": "1", "KVSTRATA_TEST_POOL_DEVICE": "cuda",
                                     "KVSTRATA_TEST_REL_SCALE": "2.5", "KVSTRATA_TEST_REL_SEED": "3"})
    assert (s.require_redis, s.require_vllm, s.pool_device, s.rel_scale, s.rel_seed) == (True, False, "cuda", 2.5, 3)
    with pytest.raises(ConfigError, match=r"rel_scale must be a finite number in \(0, .*\], got '0'"):
        Switches.from_sources(None, {"KVSTRATA_TEST_REL_SCALE": "0"})
    with pytest.raises(ConfigError, match=r"rel_scale must be a finite number .* got 'inf'"):
        Switches.from_sources(None, {"KVSTRATA_TEST_REL_SCALE": "inf"})
    with pytest.raises(ConfigError, match="unknown keys"):  # variables only
        Switches.from_sources({"require_redis": True}, {})
    assert BenchSettings.from_sources(None, {"KVSTRATA_BENCH_RESULTS": "/r"}).results == "/r"


def test_the_password_is_the_librarys_alone_and_never_shown() -> None:
    with pytest.raises(ConfigError, match="remote_password"):  # never a connector key
        ConnectorSettings.from_sources({"remote_password": "x"}, {})
    assert remote_password({"KVSTRATA_REMOTE_PASSWORD": "s3cret", "KVSTRATA_CPU_BYTES": "1G"}) == "s3cret"
    assert remote_password({"KVSTRATA_REMOTE_PASSWORD": ""}) is None
    assert "s3cret" not in repr(LibrarySettings(remote_password="s3cret"))


def test_modes_are_enums_past_the_boundary() -> None:
    # names are accepted at the boundary (as from a file or the command line), enums kept
    c = StoreConfig(LAYOUT, block_size=4, load_policy="always", pool_demotion="write_through")  # type: ignore[arg-type]
    assert c.load_policy is LoadPolicyMode.ALWAYS and c.pool_demotion is DemotionPolicy.WRITE_THROUGH
    assert StoreConfig(LAYOUT, block_size=4).load_policy is LoadPolicyMode.AUTO
    assert LoadPolicy("never", 4, 64).mode is LoadPolicyMode.NEVER
    with pytest.raises(ConfigError, match=r"StoreConfig\.load_policy must be one of"):
        StoreConfig(LAYOUT, block_size=4, load_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"StoreConfig\.pool_demotion must be 'on_evict' or 'write_through'"):
        StoreConfig(LAYOUT, block_size=4, pool_demotion="lru")  # type: ignore[arg-type]


def test_kvstrata_refuses_an_unknown_variable_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from cli import main as cli

    for bad, known in (("KVSTRATA_BENCH_RESULT", "KVSTRATA_BENCH_RESULTS"),
                       ("KVSTRATA_CPU_BYTE", "KVSTRATA_CPU_BYTES")):
        with monkeypatch.context() as m:
            m.setenv(bad, "x")
            assert cli.main(["bench", "hashing", "--tokens", "64"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and bad in err[0] and known in err[0]
