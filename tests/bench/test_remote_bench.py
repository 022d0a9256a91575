"""`kvstrata bench remote` end to end at a small size: it starts its own server, measures the
tier and both baselines in each round, and writes rates and ratios that agree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli import main as kvstrata
from cli.redis_servers import redis_binary


@pytest.mark.slow
def test_bench_remote_writes_rates_and_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    redis_binary()  # skips without redis-server (fails under KVSTRATA_TEST_REQUIRE_REDIS=1)
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    rc = kvstrata.main(["bench", "remote", "--topology", "standalone", "--sizes", "16K", "--mib", "1", "--repeat", "2"])
    assert rc == 0, capsys.readouterr().out
    out = json.loads((tmp_path / "remote.json").read_text())
    res = out["results"]["standalone"]["16K"]
    assert res["block_bytes"] == 16 << 10 and len(res["rounds"]) == 2
    med = res["median"]
    for key in ("tier_store_gbps", "tier_retrieve_gbps", "raw_set_gbps", "raw_get_gbps"):
        assert med[key] > 0, key
    for r in res["rounds"]:
        assert r["store_vs_raw"] == pytest.approx(r["tier_store_gbps"] / r["raw_set_gbps"])
    if shutil.which("redis-benchmark") or shutil.which("valkey-benchmark"):
        assert med["server_set_gbps"] > 0 and med["server_get_gbps"] > 0
        assert med["retrieve_vs_server"] > 0
    assert len(out["load_average_before_after"]) == 6
    assert "tier/server" in capsys.readouterr().out
