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

import contextlib
import difflib
import enum
import math
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, TypeVar

from kvstore.errors import ConfigError
from tiers.plugins import MAX_INT  # the largest count or size a setting takes (what a C int64 holds)

ENV_PREFIX = "KVSTRATA_"
# Families of `KVSTRATA_*` owned by other layers: the library and connector leave them alone.
TEST_PREFIX = ENV_PREFIX + "TEST_"
BENCH_PREFIX = ENV_PREFIX + "BENCH_"
OTHER_FAMILIES = (TEST_PREFIX, BENCH_PREFIX)
# Variables that moved to a family: named in the refusal, so an old setup finds the new name.
_MOVED = {ENV_PREFIX + old: family + old for family, names in (
    (TEST_PREFIX, ("REQUIRE_REDIS", "REQUIRE_VLLM", "REQUIRE_DYNAMO", "REL_SCALE", "REL_SEED", "REL_REPORT")),
    (BENCH_PREFIX, ("RESULTS", "WORKDIR"))) for old in names}
_SIZE = re.compile(r"^\s*([0-9]{1,30})\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)  # ASCII digits only
_INT = re.compile(r"^\s*[+-]?[0-9]{1,30}\s*$")  # int() would also take "1_0" and other scripts' digits
_FLOAT = re.compile(r"^\s*[+-]?([0-9]{1,30}\.?[0-9]{0,30}|\.[0-9]{1,30})([eE][+-]?[0-9]{1,4})?\s*$")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
S = TypeVar("S", bound="EnvSettings")


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: how an error names a bad value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_int(value: object) -> int | None:
    """An int (NumPy's included; never a bool or a float) or ASCII decimal text as an int; None if neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return int(value) if _INT.match(value) else None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # any object: None if it is no integer
    except TypeError:
        return None


def parse_bytes(name: str, value: object, high: int = MAX_INT) -> int:
    """An int in [0, high], or a string like "512MiB", "4G", "1048576" (K/M/G/T are powers of 1024)."""
    number = _as_int(value) if not isinstance(value, str) else None
    if isinstance(value, str) and (m := _SIZE.match(value)):
        number = int(m.group(1)) * int(1024 ** " KMGT".index(m.group(2).upper() or " "))
    if number is None:
        raise ConfigError(f"{name} must be a byte count such as 1073741824 or '1GiB', got {shown(value)}")
    if not 0 <= number <= high:
        raise ConfigError(f"{name} must be a byte count in [0, {high}], got {shown(value)}")
    return number


def parse_bool(name: str, value: object) -> bool:
    """A bool, or its text: true/false, 1/0, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{name} must be a bool (true/false/1/0), got {shown(value)}")


def parse_int(name: str, value: object, low: int, high: int) -> int:
    """An int in [low, high], or its decimal text; never a bool or a float (not even 2.0)."""
    number = _as_int(value)
    if number is None or not low <= number <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {shown(value)}")
    return number


def parse_optional_int(name: str, value: object, low: int, high: int) -> int | None:
    """None, or `parse_int`."""
    return None if value is None else parse_int(name, value, low, high)


def parse_float(name: str, value: object, low: float, high: float, *, above_low: bool = False) -> float:
    """A finite number in [low, high] (`above_low`: (low, high]), or its text; never a bool."""
    number: float | None = None
    if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (isinstance(value, str)
                                                                            and _FLOAT.match(value)):
        with contextlib.suppress(OverflowError):  # an int beyond floats
            number = float(value)
    if number is None or not math.isfinite(number) or not (low < number if above_low else low <= number) \
            or not number <= high:
        interval = f"{'(' if above_low else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{name} must be a finite number in {interval}, got {shown(value)}")
    return number


def parse_str(name: str, value: object, *, empty: bool = True, secret: bool = False) -> str:
    """`value` if it is a str of valid UTF-8 text (non-empty unless `empty`); a `secret` one
    is never shown in the error."""
    got = "a value that is not shown" if secret else shown(value)
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{name} must be a{'' if empty else ' non-empty'} str, got {got}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} is not valid UTF-8 text: {got}") from None
    return value


def number_from_text(name: str, text: str, kind: type, *, size: bool = False) -> object:
    """The int or float (`kind`) that `text` spells (a `size` also as "1GiB": `parse_bytes`,
    which raises naming `name` for text that is no size); else `text` itself, for the
    setting's own check to refuse. An infinite or NaN float is left as text too."""
    if kind is int:
        if size:
            return parse_bytes(name, text)
        return int(text) if _INT.match(text) else text
    if kind is float and _FLOAT.match(text):
        number = float(text)
        return number if math.isfinite(number) else text
    return text


def shown_default(value: object) -> str:
    """A default as a table shows it: an enum or a codec by its name, a rule by its text."""
    if hasattr(value, "label"):
        value = value.label
    elif isinstance(value, enum.Enum):
        value = value.value
    elif not isinstance(value, (str, int, float, tuple, type(None))):
        value = str(value)
    return f"`{value!r}`"


def parse_optional_str(name: str, value: object) -> str | None:
    """None, or a non-empty str of valid UTF-8 text."""
    return None if value is None else parse_str(name, value, empty=False)


def parse_path(name: str, value: object) -> str | None:
    """None, or a non-empty path as a str (without NUL bytes, which no file name holds)."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ConfigError(f"{name} must be a non-empty path, got {shown(value)}")
    return path


class Setting(NamedTuple):
    """One setting a class takes: its name (the key, and the variable's suffix), its default,
    and what it does (one line, for the docs' table)."""

    name: str
    default: object
    described: str


def described(doc: str | None) -> dict[str, str]:
    """Each entry (`name: text` indented 8 spaces, as under `Attributes:`) of a class
    docstring `doc`, on one line."""
    return {m.group(1): " ".join(m.group(2).split())
            for m in re.finditer(r"^\s{8}(\w+): (.*?)(?=^\s{8}\w+: |^\s*Attributes|\Z)", doc or "", re.M | re.S)}


def close_matches(name: object, known: list[str]) -> str:
    """The known names close to `name`, as "'a' or 'b'" ("" for none)."""
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6) if isinstance(name, str) else []
    return " or ".join(repr(n) for n in near)


def default_of(f: Field[Any]) -> object:
    """The default of a dataclass field (None where it has none)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


class EnvSettings:
    """Base of a layer's frozen settings dataclass: the parser and the docs table.

    Class attributes: `PREFIX`, the layer's variables' prefix (a setting `x` is `PREFIX +
    "X"`); `FOREIGN`, prefixes inside `PREFIX` that other layers own (not checked here);
    `SHARED`, other settings classes whose variables share this namespace (known here, parsed
    there); `KEYS_NAME`, what the extra config's keys are called, or None where there are none
    (every setting is a variable only). The settings are the dataclass's fields, but a field
    whose metadata says `{"setting": False}` (what the class derives); a subclass may take
    more (`settings`) and refuse some names with a reason (`refused`)."""

    PREFIX: ClassVar[str] = ENV_PREFIX
    FOREIGN: ClassVar[tuple[str, ...]] = OTHER_FAMILIES
    SHARED: ClassVar[tuple[type[EnvSettings], ...]] = ()
    KEYS_NAME: ClassVar[str | None] = None

    @classmethod
    def own_fields(cls) -> list[Field[Any]]:
        """The fields that are settings."""
        return [f for f in fields(cls) if f.metadata.get("setting", True)]  # type: ignore[arg-type]

    @classmethod
    def settings(cls) -> list[Setting]:
        """Every setting the class takes, in the order of its table: its own fields."""
        text = cls.described()
        return [Setting(f.name, default_of(f), text.get(f.name, "")) for f in cls.own_fields()]

    @classmethod
    def refused(cls) -> dict[str, str]:
        """Names refused as keys or variables, each with why (none here)."""
        return {}

    @classmethod
    def keys(cls) -> list[str]:
        """Names accepted as extra-config keys."""
        return [s.name for s in cls.settings()] if cls.KEYS_NAME else []

    @classmethod
    def variables(cls) -> list[str]:
        """This class's variables."""
        return [cls.PREFIX + s.name.upper() for s in cls.settings()]

    @classmethod
    def check_environ(cls, environ: Mapping[str, str]) -> None:
        """Refuse any variable of this namespace that no class of it reads, naming the known ones."""
        known = set(cls.variables()).union(*(other.variables() for other in cls.SHARED))
        strange = sorted(k for k in environ if k.startswith(cls.PREFIX) and k not in known
                         and not k.startswith(cls.FOREIGN))
        if strange:
            refused = {cls.PREFIX + name.upper(): why for name, why in cls.refused().items()}
            near = {k: close_matches(k, sorted(known)) for k in strange if k not in _MOVED and k not in refused}
            notes = [f"{k} is now {_MOVED[k]}" for k in strange if k in _MOVED] + \
                [f"{k}: {refused[k]}" for k in strange if k in refused] + \
                [f"{k}: did you mean {m}?" for k, m in near.items() if m]
            raise ConfigError(f"unknown environment variables {strange}{' (' + '; '.join(notes) + ')' if notes else ''}"
                              f"; known: {sorted(known)}"
                              + "".join(f"; {p}* belong to the {'tests' if p == TEST_PREFIX else 'benchmarks'}"
                                        for p in cls.FOREIGN))

    @classmethod
    def given(cls, extra_config: Mapping[str, object] | None = None,
              environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """The settings given: each key of `extra_config`, else its variable of `environ`
        (default `os.environ`; an empty one is not given). Raises `ConfigError` for an
        extra config that is not a mapping, a refused or unknown key (naming it, why or its
        close matches, and the known ones), or an unknown variable."""
        environ = os.environ if environ is None else environ
        if extra_config is not None and not isinstance(extra_config, Mapping):
            what = (cls.KEYS_NAME or "settings").removesuffix(" keys")
            raise ConfigError(f"{what} must be a mapping of names to values, got {shown(extra_config)}")
        extra = dict(extra_config or {})
        known = cls.keys()
        refused = cls.refused()
        what = cls.KEYS_NAME or "keys"
        for name, why in refused.items():
            if name in extra:
                raise ConfigError(f"{what}: {name!r} cannot be set: {why}")
        unknown = sorted((k for k in extra if k not in known), key=repr)
        if unknown:
            near = "".join(f"; {shown(k)}: did you mean {m}?" for k in unknown if (m := close_matches(k, known)))
            raise ConfigError(f"unknown {what} {shown(unknown)}{near}; known: {known}")
        cls.check_environ(environ)
        values: dict[str, object] = {}
        for s in cls.settings():
            env = environ.get(cls.PREFIX + s.name.upper())
            if s.name in extra:
                values[s.name] = extra[s.name]
            elif env is not None and env != "":
                values[s.name] = env
        return values

    @classmethod
    def from_sources(cls: type[S], extra_config: Mapping[str, object] | None = None,
                     environ: Mapping[str, str] | None = None) -> S:
        """Merge `extra_config` over the variables of `environ` (default `os.environ`) over
        the defaults (`given`). Raises `ConfigError` naming an unknown key or variable, or a
        bad value."""
        return cls(**cls.given(extra_config, environ))

    @classmethod
    def described(cls) -> dict[str, str]:
        """Each field's entry (`name: text` under `Attributes:`) of the class docstring, one line."""
        return described(cls.__doc__)

    @classmethod
    def table(cls) -> str:
        """The Markdown table of this class's settings (docs/configuration.md): each one's
        key, variable, default and what it does."""
        with_keys = bool(cls.keys())
        rows = ["| setting |" + (" key |" if with_keys else "") + " environment variable | default | what it does |",
                "| --- |" + (" --- |" if with_keys else "") + " --- | --- | --- |"]
        for s in cls.settings():
            key = f" `{s.name}` |" if with_keys else ""
            rows.append(f"| {s.name} |{key} `{cls.PREFIX}{s.name.upper()}` | {shown_default(s.default)} | "
                        f"{s.described} |")
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
            parse_str("remote_password", self.remote_password, empty=False, secret=True)

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
