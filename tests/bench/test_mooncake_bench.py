"""`kvstrata bench mooncake` end to end at a small size: it starts its own master, measures the
tier and the raw client in each round, and writes rates and ratios that agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main as kvstrata
from tests.mooncake_fixtures import need_mooncake


@pytest.mark.slow
def test_bench_mooncake_writes_rates_and_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    need_mooncake()
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    monkeypatch.setattr("bench.mooncake_tier.BLOCK_SIZES", (1 << 20, 2 << 20))
    assert kvstrata.main(["bench", "mooncake", "--mib", "4", "--repeat", "1"]) == 0, capsys.readouterr().out
    out = json.loads((tmp_path / "mooncake.json").read_text())
    rows = out["rows"]
    assert [(r["block_bytes"], r["op"]) for r in rows] == [(1 << 20, "store"), (1 << 20, "retrieve"),
                                                         (2 << 20, "store"), (2 << 20, "retrieve")]
    for r in rows:
        assert r["tier"] == "mooncake" and r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["ratio_range"][0] <= r["ratio"] <= r["ratio_range"][1]  # one round: all three equal
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"])
    assert 0 < out["lookup_32"]["p50_us"] <= out["lookup_32"]["p99_us"]
    assert "tier/raw" in capsys.readouterr().out
