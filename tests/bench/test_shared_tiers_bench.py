"""`kvstrata bench shared-tiers` and `kvstrata bench trace --fleet N --shared-tier JSON` end to
end at tiny sizes: rates and ratios that agree, a fleet whose shared directory serves hits,
and one clear line for each mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main as kvstrata
from cli.redis_servers import redis_binary


@pytest.fixture(autouse=True)
def results_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path / "results")
    return tmp_path / "results"


def _check(res: dict[str, object]) -> None:
    size = res["2M"]
    assert isinstance(size, dict) and size["block_bytes"] == 2 << 20 and len(size["rounds"]) == 2
    for r in size["rounds"]:
        for k in ("tier_store_gbps", "tier_retrieve_gbps", "raw_write_gbps", "raw_read_gbps"):
            assert r[k] > 0, k
        assert r["store_vs_raw"] == pytest.approx(r["tier_store_gbps"] / r["raw_write_gbps"])
    lookup = res["lookup"]
    assert isinstance(lookup, dict) and 0 < lookup["tier_p50_us"] <= lookup["tier_p99_us"]


def test_bench_shared_tiers_sharedfs(results_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvstrata.main(["bench", "shared-tiers", "--tier", '{"type": "sharedfs", "io_threads": 2}', "--sizes", "2M",
                        "--mib", "4", "--repeat", "2", "--lookups", "5", "--workdir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    out = json.loads((results_dir / "shared_tiers.json").read_text())
    _check(out["results"]["sharedfs"])
    assert out["results"]["sharedfs"]["threads"] == 2
    assert "tier/raw" in capsys.readouterr().out
    assert not any(p.name.startswith("kvstrata-shared-") for p in tmp_path.iterdir()), "its directory is removed"


@pytest.mark.slow
def test_bench_shared_tiers_remote(results_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    redis_binary()
    rc = kvstrata.main(["bench", "shared-tiers", "--tier", '{"type": "remote"}', "--sizes", "2M", "--mib", "4",
                        "--repeat", "2", "--lookups", "5"])
    assert rc == 0, capsys.readouterr().out
    _check(json.loads((results_dir / "shared_tiers.json").read_text())["results"]["remote"])


def test_fleet_with_a_shared_directory(results_dir: Path) -> None:
    rc = kvstrata.main(["bench", "trace", "--fleet", "2", "--limit", "40", "--fractions", "1/4",
                        "--shared-tier", '{"type": "sharedfs"}'])
    assert rc == 0
    out = json.loads((results_dir / "fleet_conversation_trace_sharedfs.json").read_text())
    assert out["shared_tier"] == "sharedfs"
    assert out["shared"]["hits_shared"] == out["shared"]["hits_sharedfs"] > 0
    assert out["shared"]["hit_ratio"] >= out["local"]["hit_ratio"]


@pytest.mark.parametrize(("argv", "bad"), [
    (["bench", "shared-tiers", "--tier", "{oops"], "{oops"),
    (["bench", "shared-tiers", "--tier", '{"type": "cpu", "capacity_bytes": 1024}'], "'cpu'"),
    (["bench", "shared-tiers", "--tier", '{"type": "sharedfs", "io_threads": 0}'], "io_threads"),
    (["bench", "trace", "--shared-tier", '{"type": "sharedfs"}'], "--fleet"),
    (["bench", "trace", "--fleet", "2", "--shared-tier", '{"type": "disk", "path": "/tmp/x"}'], "'disk'"),
    (["bench", "trace", "--fleet", "2", "--shared-tier", "[1]"], "[1]"),
])
def test_mistakes_get_one_line_and_exit_2(argv: list[str], bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvstrata.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert bad in err and "Traceback" not in err, err
