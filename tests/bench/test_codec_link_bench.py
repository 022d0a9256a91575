"""`kvstrata bench codec-link` end to end at a small size: a real redis-server behind the
rate-capped proxy, raw and int8 stores read back (bit-exact and within the bound, checked by
the bench), and the load policy's decisions consistent with the bandwidths it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main as kvstrata
from cli.redis_servers import redis_binary


@pytest.mark.slow
def test_bench_codec_link_writes_rates_and_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    redis_binary()  # skips without redis-server (fails under KVSTRATA_TEST_REQUIRE_REDIS=1)
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    rc = kvstrata.main(["bench", "codec-link", "--rate-gbps", "0.2", "--blocks", "2", "--rounds", "2"])
    assert rc == 0, capsys.readouterr().out
    out = json.loads((tmp_path / "codec_link.json").read_text())
    assert out["blocks"] == 2 and out["block_bytes"] == 2 << 20
    for codec in ("none", "int8"):
        assert len(out["decoded_gbps"][codec]) == 2 and all(x > 0 for x in out["decoded_gbps"][codec])
        assert out["policy_bandwidth_bps"][codec] > 0
    assert out["int8_vs_raw_per_round"] == pytest.approx(
        [i / n for i, n in zip(out["decoded_gbps"]["int8"], out["decoded_gbps"]["none"])])
    assert 0 < out["link_measured_gbps_raw_reads"] <= 0.2 * 1.2  # the cap holds (a burst of 2 ms at most)
    faster = max(("none", "int8"), key=lambda c: out["policy_bandwidth_bps"][c])
    below, between, above = out["decisions"]
    assert below["none_loads_blocks"] == below["int8_loads_blocks"] == 2  # slow engines load from both
    assert above["none_loads_blocks"] == above["int8_loads_blocks"] == 0  # fast engines recompute
    assert between[f"{faster}_loads_blocks"] == 2  # in between, only the faster tier pays
    assert between["none_loads_blocks" if faster == "int8" else "int8_loads_blocks"] == 0
    assert "load_policy='auto'" in capsys.readouterr().out
