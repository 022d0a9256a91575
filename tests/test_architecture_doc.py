"""docs/architecture.md's module table against the tree: every module of the packages is in
it, every module it names exists, and no library module is over 400 lines."""

from __future__ import annotations

import re

from tests import ROOT

PACKAGES = ("tiers", "kvstore", "engine_adapter", "router", "cli", "bench")


def _named_in_table() -> set[str]:
    """Module paths the table names; a cell's bare `x.py` after `folder/y.py` is `folder/x.py`."""
    named: set[str] = set()
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for prefix, name in re.findall(r"`([a-z_/]*?)([a-z_0-9]+\.py)`", line.split("|")[1]):
            folder = prefix or folder
            named.add(folder + name)
    return named


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" or p.parent.name == "kvstore"}


def test_every_module_is_in_the_table_and_every_row_names_a_module() -> None:
    named, modules = _named_in_table(), _modules()
    assert sorted(modules - named) == [], "modules docs/architecture.md does not list"
    assert sorted(named - modules) == [], "rows of docs/architecture.md naming no module"


def test_no_library_module_is_over_400_lines() -> None:
    sizes = {m: len((ROOT / m).read_text().splitlines()) for m in _modules() if not m.startswith("bench/")}
    assert {m: n for m, n in sizes.items() if n > 400} == {}
