"""Settings read from outside code: the machinery every layer's settings share, and the library's own.

Each layer owns its settings and their variables (docs/configuration.md has a table per layer):
- the library (`LibrarySettings`, here): environment only; the one home for secrets;
- the vLLM connector (`engine_adapter.vllm.settings.ConnectorSettings`): the keys of
  `kv_connector_extra_config`, each also the variable `KVSTRATA_<KEY upper-case>`;
- the tests (`tests/switches.py`): the family `KVSTRATA_TEST_*`;
- the `kvstrata` command and its benchmarks (`cli/settings.py`): the family `KVSTRATA_BENCH_*`.

A layer's settings are a frozen `EnvSettings` dataclass. A key given in the extra config wins
over its variable, which wins over the default. An unknown key, or an unknown variable of the
layer's namespace (its prefix, less the families other layers own), is refused with a message
naming the known ones, so a typo is never silently ignored.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from kvstore.errors import ConfigError

ENV_PREFIX = "KVSTRATA_"
# Families of `KVSTRATA_*` owned by other layers: the library and connector leave them alone.
TEST_PREFIX = ENV_PREFIX + "TEST_"
BENCH_PREFIX = ENV_PREFIX + "BENCH_"
OTHER_FAMILIES = (TEST_PREFIX, BENCH_PREFIX)
# Variables that moved to a family: named in the refusal, so an old setup finds the new name.
_MOVED = {ENV_PREFIX + old: family + old for family, names in (
    (TEST_PREFIX, ("REQUIRE_REDIS", "REQUIRE_VLLM", "REQUIRE_DYNAMO", "REL_SCALE", "REL_SEED", "REL_REPORT")),
    (BENCH_PREFIX, ("RESULTS", "WORKDIR"))) for old in names}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
S = TypeVar("S", bound="EnvSettings")


def parse_bytes(name: str, value: object) -> int:
    """An int, or a string like "512MiB", "4G", "1048576" (K/M/G/T are powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * int(1024 ** " KMGT".index(m.group(2).upper() or " "))
    raise ConfigError(f"{name} must be a byte count such as 1073741824 or '1GiB', got {value!r}")


def parse_bool(name: str, value: object) -> bool:
    """A bool, or its text: true/false, 1/0, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{name} must be a bool (true/false/1/0), got {value!r}")


def parse_int(name: str, value: object, low: int, high: int) -> int:
    """An int in [low, high], or its text."""
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not low <= number <= high or (
            isinstance(value, float) and value != number):
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return int(number)


def parse_optional_int(name: str, value: object, low: int, high: int) -> int | None:
    """None, or `parse_int`."""
    return None if value is None else parse_int(name, value, low, high)


def parse_str(name: str, value: object, *, empty: bool = True) -> str:
    """`value` if it is a str (non-empty unless `empty`)."""
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{name} must be a{'' if empty else ' non-empty'} str, got {value!r}")
    return value


def parse_path(name: str, value: object) -> str | None:
    """None, or a non-empty path as a str."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
    return str(os.fspath(value))


class EnvSettings:
    """Base of a layer's frozen settings dataclass: the parser and the docs table.

    Class attributes: `PREFIX`, the layer's variables' prefix (a field `x` is `PREFIX + "X"`);
    `FOREIGN`, prefixes inside `PREFIX` that other layers own (not checked here); `SHARED`,
    other settings classes whose variables share this namespace (known here, parsed there);
    `KEYS_NAME`, what the extra config's keys are called, or None where there are none (every
    field is a variable only)."""

    PREFIX: ClassVar[str] = ENV_PREFIX
    FOREIGN: ClassVar[tuple[str, ...]] = OTHER_FAMILIES
    SHARED: ClassVar[tuple[type[EnvSettings], ...]] = ()
    KEYS_NAME: ClassVar[str | None] = None

    @classmethod
    def keys(cls) -> list[str]:
        """Names accepted as extra-config keys."""
        return [f.name for f in fields(cls)] if cls.KEYS_NAME else []  # type: ignore[arg-type]

    @classmethod
    def variables(cls) -> list[str]:
        """This class's variables."""
        return [cls.PREFIX + f.name.upper() for f in fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def check_environ(cls, environ: Mapping[str, str]) -> None:
        """Refuse any variable of this namespace that no class of it reads, naming the known ones."""
        known = set(cls.variables()).union(*(other.variables() for other in cls.SHARED))
        strange = sorted(k for k in environ if k.startswith(cls.PREFIX) and k not in known
                         and not k.startswith(cls.FOREIGN))
        if strange:
            moved = [f"{k} is now {_MOVED[k]}" for k in strange if k in _MOVED]
            raise ConfigError(f"unknown environment variables {strange}{' (' + '; '.join(moved) + ')' if moved else ''}"
                              f"; known: {sorted(known)}"
                              + "".join(f"; {p}* belong to the {'tests' if p == TEST_PREFIX else 'benchmarks'}"
                                        for p in cls.FOREIGN))

    @classmethod
    def from_sources(cls: type[S], extra_config: Mapping[str, object] | None = None,
                     environ: Mapping[str, str] | None = None) -> S:
        """Merge `extra_config` over the variables of `environ` (default `os.environ`) over
        the defaults. Raises `ConfigError` naming an unknown key or variable, or a bad value."""
        environ = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(cls.keys()))
        if unknown:
            raise ConfigError(f"unknown {cls.KEYS_NAME or 'keys'} {unknown}; known: {cls.keys()}")
        cls.check_environ(environ)
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            env = environ.get(cls.PREFIX + f.name.upper())
            if f.name in extra:
                values[f.name] = extra[f.name]
            elif env is not None and env != "":
                values[f.name] = env
        return cls(**values)

    @classmethod
    def described(cls) -> dict[str, str]:
        """Each field's entry (`name: text` under `Attributes:`) of the class docstring, one line."""
        doc = cls.__doc__ or ""
        return {m.group(1): " ".join(m.group(2).split())
                for m in re.finditer(r"^\s{8}(\w+): (.*?)(?=^\s{8}\w+: |^\s*Attributes|\Z)", doc, re.M | re.S)}

    @classmethod
    def table(cls) -> str:
        """The Markdown table of this class's settings (docs/configuration.md): each field's
        docstring entry (`name: text` under `Attributes:`) and default."""
        described = cls.described()
        with_keys = bool(cls.keys())
        rows = ["| setting |" + (" key |" if with_keys else "") + " environment variable | default | what it does |",
                "| --- |" + (" --- |" if with_keys else "") + " --- | --- | --- |"]
        for f in fields(cls):  # type: ignore[arg-type]
            default = f.default if f.default is not MISSING else None
            shown = getattr(default, "label", default.value if isinstance(default, enum.Enum) else default)
            key = f" `{f.name}` |" if with_keys else ""
            rows.append(f"| {f.name} |{key} `{cls.PREFIX}{f.name.upper()}` | `{shown!r}` | "
                        f"{described.get(f.name, '')} |")
        return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class LibrarySettings(EnvSettings):
    """The library's own settings: environment only, read where the library needs them.

    The library reads only its own variables: the rest of `KVSTRATA_*` is the connector's, which
    refuses the unknown ones (the library cannot tell a connector key's variable from a typo).

    Attributes:
        remote_password: the remote tier's password when its URL has none (never logged).
    """

    remote_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.remote_password is not None:
            parse_str("remote_password", self.remote_password, empty=False)

    @classmethod
    def check_environ(cls, environ: Mapping[str, str]) -> None:
        """Nothing: the connector and `kvstrata` check the shared namespace."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LibrarySettings:
        """The library's variables of `environ` (default `os.environ`), read now."""
        return cls.from_sources(None, environ)


def remote_password(environ: Mapping[str, str] | None = None) -> str | None:
    """`KVSTRATA_REMOTE_PASSWORD`: the one place any layer reads it."""
    return LibrarySettings.from_environ(environ).remote_password
