"""`kvstrata bench prefetch` at a small size: both timings come from one run, and every
retrieve after a prefetch was served by the CPU tier (the bench asserts it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main as kvstrata


def test_bench_prefetch_times_both_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    rc = kvstrata.main(["bench", "prefetch", "--blocks", "4", "--trials", "2"])
    assert rc == 0, capsys.readouterr().out
    res = json.loads((tmp_path / "prefetch.json").read_text())
    assert res["num_blocks"] == 4 and res["trials"] == 2
    assert all(res[k]["median_ms"] >= res[k]["min_ms"] > 0 for k in ("from_disk", "after_prefetch", "prefetch"))
