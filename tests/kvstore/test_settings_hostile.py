"""Every setting under hostile values: the connector's keys and variables, every layer's
`KVSTRATA_*` variables, and every `StoreConfig` and `KVLayout` field. Each value is either
taken (and then of the field's type) or refused with one `ConfigError` naming the setting;
never another exception (an `OverflowError` from `int(inf)`, a `TypeError`), never a float
where an int belongs. The keys come from the classes, so a new setting is covered at once."""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cli.settings import BenchSettings
from engine_adapter.vllm.settings import ConnectorSettings, library_keys
from kvstore import ConfigError, KVLayout, StoreConfig
from kvstore.settings import EnvSettings, LibrarySettings
from tests.switches import Switches

HOSTILE: list[object] = [
    float("inf"), float("-inf"), float("nan"), -1, 0, 2**63, 2**64, -(2**64), 10**400, 1e400, 2.5, 1.0, -0.0,
    "", [], {}, None, True, False, (), b"1", object(),
    "Infinity", "-Infinity", "NaN", "inf", "1e400", "2.5", "18446744073709551616", "1_0", "\uff11\uff12", " 7 ",
    "\udcff", "x\x00y", "0x10", "x" * 5000,
]
TEXTS = [v for v in HOSTILE if isinstance(v, str)]
values = st.one_of(st.sampled_from(HOSTILE), st.floats(), st.integers(-(2**70), 2**70), st.text(max_size=12),
                   st.booleans(), st.none(), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.binary(max_size=4))
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)
LAYERS: tuple[type[EnvSettings], ...] = (LibrarySettings, ConnectorSettings, Switches, BenchSettings)
CONNECTOR_KEYS = ConnectorSettings.keys()
PASSED = set(library_keys())
STORE_FIELDS = [f.name for f in dataclasses.fields(StoreConfig) if f.name != "layout"]
LAYOUT_FIELDS = [f.name for f in dataclasses.fields(KVLayout)]
VARIABLES = [(layer, s.name) for layer in LAYERS for s in layer.settings()]


def conforms(value: object, hint: object) -> bool:
    """Whether a taken value has its field's type, where the type is a plain one (int, bool,
    str, float, an enum, or a union of them; an int fits an int64, a float is finite); other
    hints are not checked."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:  # never a bool, a float, or more than a C int64 holds
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint in (bool, str) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, hint)  # type: ignore[arg-type]
    return True


def taken_or_named(build: Any, name: str, value: object, *, secret: bool = False) -> object:
    """`build()`, or None if it refused with one `ConfigError` that names `name` (and, for a
    secret, does not show the value). Any other exception fails the test."""
    try:
        return build()
    except ConfigError as exc:
        message = str(exc)
        assert name in message, f"{name}={value!r:.80}: the error does not name the setting: {message}"
        assert "\n" not in message, message
        if secret and isinstance(value, str) and len(value) > 3:
            assert value not in message, f"the secret {name} is shown: {message}"
        return None


def taken(made: object, name: str) -> tuple[object, object]:
    """The value a settings object took for `name`, and its type hint: a library setting the
    connector passes through is `StoreConfig`'s."""
    if isinstance(made, ConnectorSettings) and name in PASSED:
        return made.value(name), typing.get_type_hints(StoreConfig)[name]
    return getattr(made, name), typing.get_type_hints(type(made))[name]


def check_connector_key(key: str, value: object) -> None:
    made = taken_or_named(lambda: ConnectorSettings.from_sources({key: value}, {}), key, value)
    if made is not None:
        value_taken, hint = taken(made, key)
        assert conforms(value_taken, hint), f"{key}={value!r:.80} taken as {value_taken!r:.80}"


def check_variable(layer: type[EnvSettings], name: str, text: str) -> None:
    variable = layer.PREFIX + name.upper()
    made = taken_or_named(lambda: layer.from_sources(None, {variable: text}), name, text,
                          secret=name == "remote_password")
    if made is not None:
        assert conforms(*taken(made, name)), (variable, text)


def check_store_field(name: str, value: object) -> None:
    made = taken_or_named(lambda: StoreConfig(layout=LAYOUT, **{name: value}), name, value)
    if made is not None:
        assert conforms(getattr(made, name), typing.get_type_hints(StoreConfig)[name]), (name, value)


def check_layout_field(name: str, value: object) -> None:
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, name: value}
    made = taken_or_named(lambda: KVLayout(**fields), name, value)
    if made is not None and name != "dtype":
        assert conforms(getattr(made, name), int), (name, value)


def test_the_keys_are_the_classes_fields() -> None:
    assert "metrics_port" in CONNECTOR_KEYS and "tiers" in CONNECTOR_KEYS
    assert len(CONNECTOR_KEYS) == len(ConnectorSettings.own_fields()) + len(PASSED)
    assert "block_size" in STORE_FIELDS and "remote_password" in dict(VARIABLES).values()


@pytest.mark.parametrize("key", CONNECTOR_KEYS)
def test_every_connector_key_takes_or_names_each_hostile_value(key: str) -> None:
    for value in HOSTILE:
        check_connector_key(key, value)


@pytest.mark.parametrize(("layer", "name"), VARIABLES, ids=[f"{layer.__name__}.{n}" for layer, n in VARIABLES])
def test_every_variable_takes_or_names_each_hostile_text(layer: type[EnvSettings], name: str) -> None:
    for text in TEXTS:
        if "\x00" not in text and "\udcff" not in text:  # no environment holds these
            check_variable(layer, name, text)


@pytest.mark.parametrize("name", STORE_FIELDS)
def test_every_store_config_field_takes_or_names_each_hostile_value(name: str) -> None:
    for value in HOSTILE:
        check_store_field(name, value)


@pytest.mark.parametrize("name", LAYOUT_FIELDS)
def test_every_layout_field_takes_or_names_each_hostile_value(name: str) -> None:
    for value in HOSTILE:
        check_layout_field(name, value)


def test_the_reported_ones_are_refused() -> None:
    """The values of the report: vLLM's JSON parser takes `Infinity` in `--kv-transfer-config`."""
    for value in (float("inf"), float("nan"), 1e400, 2.5, 1.0, True, 2**64, "1_0", "\uff11\uff12"):
        with pytest.raises(ConfigError, match="metrics_port must be an integer"):
            ConnectorSettings.from_sources({"metrics_port": value}, {})
    for name in ("block_size", "io_threads", "cpu_bytes"):
        for value in (float("inf"), 2.5, True, 2**64):
            with pytest.raises(ConfigError, match=rf"StoreConfig\.{name} must be an int"):
                StoreConfig(layout=LAYOUT, **{name: value})
    with pytest.raises(ConfigError, match=r"StoreConfig\.write_through must be a bool"):
        StoreConfig(layout=LAYOUT, write_through=[])
    with pytest.raises(ConfigError, match="events_topic must be a str"):
        ConnectorSettings.from_sources({"events_topic": 5}, {})
    with pytest.raises(ConfigError, match="kv_connector_extra_config must be a mapping"):
        ConnectorSettings.from_sources([("metrics_port", 1)], {})  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CONNECTOR_KEYS), values)
def test_connector_keys_under_generated_values(key: str, value: object) -> None:
    check_connector_key(key, value)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STORE_FIELDS), values)
@example("block_size", 4194305)  # found by a run: a block too large for the CPU tier's default bytes
def test_store_config_fields_under_generated_values(name: str, value: object) -> None:
    check_store_field(name, value)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VARIABLES), st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                                                  blacklist_characters="\x00"), max_size=12))
def test_variables_under_generated_text(variable: tuple[type[EnvSettings], str], text: str) -> None:
    check_variable(*variable, text)
