"""The connector's stats file (`stats_path`): current after each step's write, so a process
killed during vLLM's shutdown leaves its last step's counters, not an older copy."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine_adapter.vllm.stats import ConnectorStats


def _read(path: Path) -> dict[str, int]:
    (name,) = os.listdir(path)
    assert name == f"scheduler-{os.getpid()}.json"
    with open(path / name) as f:
        return dict(json.load(f))


def test_a_changed_counter_is_written_and_an_unchanged_file_is_left_alone(tmp_path: Path) -> None:
    stats = ConnectorStats("scheduler", str(tmp_path))
    stats.count("lookups", 1)
    stats.write(if_changed=True)
    assert _read(tmp_path) == {"lookups": 1}
    target = tmp_path / f"scheduler-{os.getpid()}.json"
    os.utime(target, (0, 0))
    stats.write(if_changed=True)  # nothing changed: the file is not rewritten
    assert target.stat().st_mtime == 0
    stats.set("policy_skipped_blocks", 31)
    stats.count("lookups", 1)
    stats.write(if_changed=True)
    assert _read(tmp_path) == {"lookups": 2, "policy_skipped_blocks": 31}
    os.utime(target, (0, 0))
    stats.write()  # unconditional: rewritten
    assert target.stat().st_mtime > 0


def test_without_a_path_nothing_is_written(tmp_path: Path) -> None:
    stats = ConnectorStats("scheduler", None)
    stats.count("lookups", 1)
    stats.write(if_changed=True)
    stats.write()
    assert stats.counters == {"lookups": 1}
    assert os.listdir(tmp_path) == []
