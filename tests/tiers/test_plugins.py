"""The registry every family of components shares: registration, and a config from an object,
a name or a plain dict naming a module outside the packages."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiers.errors import ConfigError
from tiers.plugins import Registry


@dataclass(frozen=True)
class Shape:
    """The base of the family under test."""


class Widget:
    """What a `Box` config makes (a config may name it by this class's name)."""


def family() -> Registry[Shape]:
    reg: Registry[Shape] = Registry("shape", Shape)

    @reg.register("box", makes=Widget)
    @dataclass(frozen=True)
    class Box(Shape):
        side: int = 1

        def __post_init__(self) -> None:
            if not isinstance(self.side, int) or self.side <= 0:
                raise ConfigError(f"Box.side must be an int > 0, got {self.side!r}")

    @reg.register("dot")
    @dataclass(frozen=True)
    class Dot(Shape):
        pass

    return reg


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on `sys.path` outside the packages, for modules the tests write."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_config_from_an_object_a_name_or_a_dict() -> None:
    reg = family()
    box = reg.get("box")
    assert reg.names() == ["box", "dot"] and reg.name_of(box(2)) == "box"
    assert reg.config_from(box(3), what="w") == box(3)
    assert reg.config_from("box", what="w") == box(1)
    assert reg.config_from({"type": "box", "side": 4}, what="w") == box(4)
    assert reg.config_from(json.loads('{"type": "Box", "side": 5}'), what="w") == box(5)  # the config's class name
    assert reg.config_from({"type": "Widget"}, what="w") == box(1)  # the name of the class it makes
    assert reg.config_from({"type": box}, what="w") == box(1)


def test_each_bad_config_is_one_error_naming_it() -> None:
    reg = family()
    with pytest.raises(ConfigError, match=r"^w\.type='cube' is not a registered shape; registered: \['box', 'dot'\]$"):
        reg.config_from({"type": "cube"}, what="w")
    with pytest.raises(ConfigError, match=r"^w='cube' is not a registered shape"):
        reg.config_from("cube", what="w")
    with pytest.raises(ConfigError, match=r"^w: shape 'box' has no field 'sides' \(given 2\); its fields: \['side'\]$"):
        reg.config_from({"type": "box", "sides": 2}, what="w")
    with pytest.raises(ConfigError, match=r"^w: Box\.side must be an int > 0, got -1$"):
        reg.config_from({"type": "box", "side": -1}, what="w")
    with pytest.raises(ConfigError, match=r"^w needs a 'type'"):
        reg.config_from({"side": 2}, what="w")
    with pytest.raises(ConfigError, match=r"^w must be a registered shape name, a dict"):
        reg.config_from(3, what="w")
    with pytest.raises(ConfigError, match=r"^w\.module_path='no_such_module_here' cannot be imported: "
                                          r"ModuleNotFoundError"):
        reg.config_from({"type": "box", "module_path": "no_such_module_here"}, what="w")


def test_a_required_field_missing_is_named() -> None:
    reg: Registry[Shape] = Registry("shape", Shape)

    @reg.register("line")
    @dataclass(frozen=True)
    class Line(Shape):
        length: int

    with pytest.raises(ConfigError, match=r"^w: shape 'line' needs \['length'\]$"):
        reg.config_from("line", what="w")
    assert reg.config_from({"type": "line", "length": 2}, what="w") == Line(2)


def test_registration_refuses_a_taken_name_a_bad_name_and_classes_that_are_not_frozen_configs() -> None:
    reg = family()

    @dataclass(frozen=True)
    class Other(Shape):
        pass

    with pytest.raises(ConfigError, match=r"^shape 'box' is registered already, by tests\.tiers\.test_plugins\."):
        reg.add("box", Other)
    with pytest.raises(ConfigError, match=r"is registered already, as shape 'box'"):
        reg.add("cube", reg.get("box"))
    with pytest.raises(ConfigError, match="a shape name is a lower-case identifier, got 'Cube'"):
        reg.add("Cube", Other)

    class Loose(Shape):  # not decorated: its annotations would not be fields
        side: int

    with pytest.raises(ConfigError, match="must be a frozen dataclass"):
        reg.add("loose", Loose)
    with pytest.raises(ConfigError, match="must subclass Shape"):
        reg.add("widget", Widget)
    assert reg.names() == ["box", "dot"]  # nothing refused was registered


def test_a_module_outside_the_packages_registers_by_being_imported(plugin_dir: Path) -> None:
    (plugin_dir / "kvs_test_shapes.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from tests.tiers.test_plugins import OUTSIDE, Shape

        @OUTSIDE.register("ring")
        @dataclass(frozen=True)
        class Ring(Shape):
            radius: float = 1.0

        class NotAShape:
            pass
    """))
    assert OUTSIDE.names() == []
    ring = OUTSIDE.config_from({"type": "Ring", "module_path": "kvs_test_shapes", "radius": 2.5}, what="w")
    assert type(ring).__name__ == "Ring" and OUTSIDE.names() == ["ring"]  # imported by the config: registered
    assert OUTSIDE.config_from({"type": "ring", "module_path": "kvs_test_shapes"}, what="w") == type(ring)()
    with pytest.raises(ConfigError, match=r"^w\.type='NotAShape' in module 'kvs_test_shapes' is not a registered"):
        OUTSIDE.config_from({"type": "NotAShape", "module_path": "kvs_test_shapes"}, what="w")


def test_builtins_are_imported_when_first_asked_and_listed_first(plugin_dir: Path) -> None:
    (plugin_dir / "kvs_test_builtin_shapes.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from tests.tiers.test_plugins import Shape, REG

        @REG.register("square")
        @dataclass(frozen=True)
        class Square(Shape):
            pass
    """))
    global REG
    REG = Registry("shape", Shape, ("kvs_test_builtin_shapes",))

    @REG.register("late")  # registered before the built-ins were imported: listed after them
    @dataclass(frozen=True)
    class Late(Shape):
        pass

    assert REG.names() == ["square", "late"]
    with pytest.raises(ConfigError, match="'square' is registered already"):  # a built-in's name is taken
        REG.add("square", Late)


REG: Registry[Shape] = Registry("shape", Shape)
OUTSIDE: Registry[Shape] = Registry("shape", Shape)


def test_a_refused_config_never_shows_its_values() -> None:
    """A tier config may hold a URL with a password: an error names its keys, never its values."""
    from kvstore.config import StoreConfig
    from kvstore.layout import KVLayout

    secret = "redis://user:hunter2-secret@127.0.0.1:6379"
    for tiers in ([{"url": secret}], {"type": "remote", "url": secret}):
        with pytest.raises(ConfigError) as refused:
            StoreConfig(KVLayout(2, 2, 16), block_size=16, namespace="m", tiers=tiers)  # type: ignore[arg-type]
        assert "hunter2" not in str(refused.value) and "tiers" in str(refused.value)
