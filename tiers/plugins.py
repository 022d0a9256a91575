"""Registries of pluggable components (tiers, eviction policies, admission rules, codecs), and
the checks their configs share.

Each component registers itself, in its own module, by name together with a frozen config
class of its own that validates its own fields (`Registry.register`). A config then names it
in one of three forms (`Registry.config_from`):

- a config object (`S3FIFOConfig(small_share=0.2)`);
- its registered name (`"s3fifo"`): the config's defaults;
- a dict `{"type": NAME_OR_CLASS, "module_path": "pkg.mod", ...its fields}`, plain JSON: the
  module, when given, is imported (importing it registers what it defines), then `type` is
  looked up as a registered name, or as the name of a class in that module (the config
  class, or the component class a registration says it makes). This is the convention of
  vLLM's secondary tiers and LMCache's plugin adapters: a component outside kvstrata needs
  no edit to kvstrata. A config can import any module on the path: take configs from people
  you would let run code.

Built-in components register when their module is imported; each registry imports its
built-in modules (`builtins`) the first time it is asked, and lists them first, in that order.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar, cast

import numpy as np

from tiers.errors import ConfigError

C = TypeVar("C")
R = TypeVar("R", bound=type)

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def is_int_at_least(value: object, low: int) -> bool:
    """Whether `value` is an int (NumPy ints included, bools not) of at least `low`."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= low)


MAX_INT = 2**63 - 1  # the largest count or size a config takes (what a C int64 holds)


def require_int(name: str, value: object, low: int, error: type[Exception] = ConfigError, high: int = MAX_INT) -> int:
    """`value` as an int in [low, high] (never a bool or a float), else `error` naming it: the
    one check of every count, size and index kvstrata takes from a caller."""
    if not is_int_at_least(value, low) or value > high:  # type: ignore[operator]  # an int once at least low
        bound = ("> 0" if low == 1 else f">= {low}") if high == MAX_INT else f"in [{low}, {high}]"
        raise error(f"{name} must be an int {bound}, got {value!r}")
    assert isinstance(value, (int, np.integer))
    return int(value)


def check_path(value: object, what: str) -> str:
    """`value` (a str or path-like) as a non-empty path without NUL bytes; `ConfigError`
    naming `what` otherwise: the check of every directory a tier's config names."""
    try:
        path = os.fspath(value)  # type: ignore[call-overload]  # anything: refused below if not a path
    except TypeError:
        raise ConfigError(f"{what} must be a path, got {value!r}") from None
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ConfigError(f"{what} must be a non-empty path without NUL bytes, got {path!r}")
    return path


class Entry(NamedTuple):
    """One registration: the name, the config class, and the class its configs make (if said)."""

    name: str
    config: type[Any]
    makes: type[Any] | None


def _same_class(a: type[Any], b: type[Any]) -> bool:
    """Whether `a` and `b` are one class defined twice (a module imported again)."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)



def shape(value: object) -> str:
    """What `value` is, without its contents (a config may hold a URL with a password): its
    type, and a mapping's keys."""
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(str(k) for k in value)[:16]}"
    return f"a {type(value).__name__}"

class Registry(Generic[C]):
    """The config classes of one family of components (`what`), by name.

    Invariant: a name maps to one frozen dataclass subclassing `base`; a config class has one
    name. Registering a name again with the same class (its module imported again) replaces
    it; with another class it is refused.

    Args:
        what: the family's name in messages ("tier", "eviction policy", ...).
        base: the class every config of the family subclasses.
        builtins: modules whose import registers the built-in components, in the order they
            are listed (`entries`); imported the first time the registry is asked.
    """

    def __init__(self, what: str, base: type[Any], builtins: tuple[str, ...] = ()) -> None:
        self.what = what
        self.base = base
        self._builtins = builtins
        self._loaded = not builtins
        self._loading = False
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}

    # -- registration --------------------------------------------------------------------
    def register(self, name: str, *, makes: type[Any] | None = None) -> Callable[[R], R]:
        """Class decorator: register the decorated config class under `name` (`add`)."""

        def add(config_cls: R) -> R:
            self.add(name, config_cls, makes=makes)
            return config_cls

        return add

    def add(self, name: str, config_cls: type[Any], *, makes: type[Any] | None = None) -> None:
        """Register `config_cls` under `name`; `makes` is the class its configs build, so that
        a config may name it by that class's name. Raises `ConfigError` for a bad name or
        class, or a name or class registered already as another."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"a {self.what} name is a lower-case identifier, got {name!r}")
        if not isinstance(config_cls, type) or not issubclass(config_cls, self.base):
            raise ConfigError(f"a {self.what} config must subclass {self.base.__name__}, got {config_cls!r}")
        params = vars(config_cls).get("__dataclass_params__")  # its own: a subclass not decorated has none
        if params is None or not params.frozen:
            raise ConfigError(f"the {self.what} config {config_cls.__qualname__} must be a frozen dataclass "
                              "(decorated itself)")
        if not self._is_builtin(config_cls):
            self._load_builtins()  # a name taken by a built-in is refused here, not later
        taken = self._entries.get(name)
        if taken is not None and not _same_class(taken.config, config_cls):
            raise ConfigError(f"{self.what} {name!r} is registered already, by {taken.config.__module__}."
                              f"{taken.config.__qualname__}")
        other = next((e.name for e in self._entries.values() if e.name != name and _same_class(e.config, config_cls)),
                     None)
        if other is not None:
            raise ConfigError(f"{config_cls.__qualname__} is registered already, as {self.what} {other!r}")
        self._entries[name] = Entry(name, config_cls, makes)

    # -- queries -------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every registration: the built-ins first, in the order of `builtins`, then the
        others in the order they registered."""
        self._load_builtins()
        order = {m: i for i, m in enumerate(self._builtins)}
        rank = {e.name: min((i for m, i in order.items() if self._within(e.config, m)), default=len(order))
                for e in self._entries.values()}
        return sorted(self._entries.values(), key=lambda e: rank[e.name])

    def names(self) -> list[str]:
        """The registered names, in the order of `entries`."""
        return [e.name for e in self.entries()]

    def get(self, name: str) -> type[C]:
        """The config class registered as `name`; `ConfigError` listing the names otherwise."""
        self._load_builtins()
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ConfigError(f"{name!r} is not a registered {self.what}; registered: {self.names()}")
        return entry.config

    def name_of(self, config: object) -> str:
        """The name a config object or class is registered as; `ConfigError` if it is not."""
        cls = config if isinstance(config, type) else type(config)
        self._load_builtins()
        for e in self._entries.values():
            if e.config is cls:
                return e.name
        raise ConfigError(f"{cls.__qualname__} is not a registered {self.what} config")

    def config_from(self, value: object, *, what: str) -> C:
        """`value` as a config of this family (the forms are in the module docstring).
        `what` names the value in errors: an unknown type, module, or field, a field
        missing, or a field the config's own checks refuse is one `ConfigError` naming it."""
        if isinstance(value, self.base):
            return cast(C, value)
        if isinstance(value, str):
            return self._build(self._lookup(value, None, what), {}, what)
        if isinstance(value, Mapping):
            fields = dict(value)
            if "type" not in fields:
                raise ConfigError(f"{what} needs a 'type' (a registered {self.what} or a class name), got "
                                  f"{shape(value)}")
            kind = fields.pop("type")
            module_path = fields.pop("module_path", None)
            if module_path is not None:
                self._import(module_path, what)
            return self._build(self._lookup(kind, module_path, f"{what}.type"), fields, what)
        raise ConfigError(f"{what} must be a registered {self.what} name, a dict with its 'type' (and "
                          f"'module_path'), or a {self.base.__name__}; got {shape(value)}")

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _within(cls: type[Any], module: str) -> bool:
        return cls.__module__ == module or cls.__module__.startswith(module + ".")

    def _is_builtin(self, cls: type[Any]) -> bool:
        return any(self._within(cls, m) for m in self._builtins)

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        with self._lock:  # another thread waits until every built-in has registered
            if self._loaded or self._loading:  # loaded meanwhile, or asked again by a built-in's import
                return
            self._loading = True
            try:
                for module in self._builtins:
                    importlib.import_module(module)
            finally:
                self._loading = False
            self._loaded = True

    def _import(self, module_path: object, what: str) -> None:
        if not isinstance(module_path, str) or not module_path:
            raise ConfigError(f"{what}.module_path must be a module name, got {module_path!r}")
        try:
            importlib.import_module(module_path)
        except Exception as exc:  # a plugin's import may fail in any way: one clear error
            raise ConfigError(f"{what}.module_path={module_path!r} cannot be imported: "
                              f"{type(exc).__name__}: {exc}") from None

    def _lookup(self, kind: object, module_path: str | None, what: str) -> Entry:
        self._load_builtins()
        if isinstance(kind, str) and kind in self._entries:
            return self._entries[kind]
        shown = kind.__qualname__ if isinstance(kind, type) else repr(kind)
        if isinstance(kind, str) and module_path is not None:
            kind = getattr(importlib.import_module(module_path), kind, kind)
        for e in self._entries.values():
            if (isinstance(kind, type) and kind in (e.config, e.makes)) or (
                    isinstance(kind, str) and module_path is None
                    and kind in (e.config.__name__, getattr(e.makes, "__name__", None))):
                return e
        where = "" if module_path is None else f" in module {module_path!r}"
        raise ConfigError(f"{what}={shown}{where} is not a registered {self.what}; registered: {self.names()}")

    def _build(self, entry: Entry, fields: dict[Any, Any], what: str) -> C:
        init = {f.name: f for f in dataclasses.fields(entry.config) if f.init}
        unknown = sorted(str(k) for k in fields if k not in init)
        if unknown:
            raise ConfigError(f"{what}: {self.what} {entry.name!r} has no field {unknown[0]!r} (given "
                              f"{fields[unknown[0]]!r}); its fields: {sorted(init)}")
        missing = sorted(n for n, f in init.items() if n not in fields and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"{what}: {self.what} {entry.name!r} needs {missing}")
        try:
            config: C = entry.config(**fields)
        except (ValueError, TypeError) as exc:  # ConfigError included: its message names the field
            raise ConfigError(f"{what}: {exc}") from None
        return config
