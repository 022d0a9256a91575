"""docs/architecture.md's folder list against the tree: every folder of Python code is named
in it, every folder it names exists, and no library module is over 400 lines."""

from __future__ import annotations

import re

from tests import ROOT

PACKAGES = ("tiers", "kvevents", "kvstore", "engine_adapter", "router", "cli", "bench")
SECTION = "## Folders"


def _named_folders() -> set[str]:
    """The folders (backquoted, ending in `/`) that the bullets of the doc's folder list name."""
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    assert SECTION in lines, f"docs/architecture.md has no {SECTION!r} section"
    named: set[str] = set()
    for line in lines[lines.index(SECTION) + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("- "):
            named.update(re.findall(r"`(\.?[A-Za-z0-9_/.-]+/)`", line))
    return named


def _code_folders() -> set[str]:
    """Every folder of the packages and of tests/ that holds Python code, as `path/`."""
    return {str(p.parent.relative_to(ROOT)) + "/" for top in (*PACKAGES, "tests") for p in (ROOT / top).rglob("*.py")
            if "__pycache__" not in p.parts}


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_every_code_folder_is_in_the_folder_list() -> None:
    assert sorted(_code_folders() - _named_folders()) == [], "folders docs/architecture.md does not list"


def test_every_folder_the_list_names_exists() -> None:
    assert sorted(f for f in _named_folders() if not (ROOT / f).is_dir()) == [], \
        "docs/architecture.md names folders that do not exist"


def test_no_library_module_is_over_400_lines() -> None:
    sizes = {m: len((ROOT / m).read_text().splitlines()) for m in _modules() if not m.startswith("bench/")}
    assert {m: n for m, n in sizes.items() if n > 400} == {}
