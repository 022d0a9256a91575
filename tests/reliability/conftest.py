"""Figures of the reliability suite: every test adds its counts; the session prints and saves them.

The JSON goes to `KVSTRATA_TEST_REL_REPORT` (default `results/reliability.json`, not committed);
`docs/reliability.md` quotes a run of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.switches import switches

from .budget import BUDGET

_FIGURES: dict[str, dict[str, Any]] = {}


class Figures:
    """Counts of one test, merged into the session's report under the test's name."""

    def __init__(self, name: str) -> None:
        self._entry = _FIGURES.setdefault(name, {})

    def add(self, key: str, value: float) -> None:
        self._entry[key] = self._entry.get(key, 0) + value

    def set(self, key: str, value: Any) -> None:
        self._entry[key] = value


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    yield Figures(request.node.name)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    path = Path(switches().rel_report)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"scale": BUDGET.scale, "seed": BUDGET.seed, "tests": _FIGURES}
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    terminalreporter.section("reliability figures")
    for name, entry in sorted(_FIGURES.items()):
        counts = ", ".join(f"{k}={v}" for k, v in sorted(entry.items()))
        terminalreporter.write_line(f"{name}: {counts}")
    terminalreporter.write_line(f"(saved to {path})")
