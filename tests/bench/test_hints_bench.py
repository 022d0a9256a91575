"""`kvstrata bench hints` at a small size: retain hints, and the flood at priority "low", against
the same store without them and against Belady on one replay; the gap-closed figures are
computed from the same run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cli import main as kvstrata


def test_bench_hints_reports_each_policy_with_and_without_hints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    rc = kvstrata.main(["bench", "hints", "--sessions", "4", "--rounds", "5", "--context-blocks", "8", "--flood", "16",
                        "--flood-blocks", "8", "--cpu-blocks", "64,96"])
    assert rc == 0, capsys.readouterr().out
    res = json.loads((tmp_path / "hints.json").read_text())["results"]
    assert set(res) == {f"{p}/{c}" for p in ("lru", "s3fifo", "arc") for c in (64, 96)}
    for r in res.values():
        assert 0 <= r["no_hints"] <= r["belady"] <= r["infinite"] <= 1
        assert r["retain"] <= r["infinite"] and r["low_flood"] <= r["infinite"]
        if r["belady"] > r["no_hints"]:
            assert math.isclose(r["gap_closed"], (r["retain"] - r["no_hints"]) / (r["belady"] - r["no_hints"]))
            assert math.isclose(r["gap_closed_low"], (r["low_flood"] - r["no_hints"]) / (r["belady"] - r["no_hints"]))
    assert res["lru/64"]["retain"] > res["lru/64"]["no_hints"]  # the flood evicts the sessions without hints
    assert res["lru/64"]["low_flood"] > res["lru/64"]["no_hints"]  # a low flood leaves the sessions' blocks


def test_bench_hints_refuses_bad_sizes_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvstrata.main(["bench", "hints", "--cpu-blocks", "64,x"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-blocks" in err and len(err.strip().splitlines()) == 1
