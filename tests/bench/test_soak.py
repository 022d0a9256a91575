"""The short soak the suite runs: engines, a durability probe, a real `redis-server` and a
cluster, `kvstrata router`, faults at random moments (`bench/soak.py`); no block may come back
wrong, no acknowledged durable block may be lost, no raw exception may leave the store, the
counters and the router must agree with the stores, and every kind of fault must land."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main as kvstrata
from cli.redis_servers import redis_binary


@pytest.mark.slow
def test_short_soak_finds_no_wrong_byte_and_loses_no_durable_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    redis_binary()  # skips without redis-server (fails under KVSTRATA_TEST_REQUIRE_REDIS=1)
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    rc = kvstrata.main(["bench", "soak", "--minutes", "1.5", "--seed", "7"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads((tmp_path / "soak.json").read_text())
    assert res["wrong_blocks"] == 0 and res["lost_blocks"] == 0 and res["late"] == 0
    assert {k: v for k, v in res["errors"].items() if not k.startswith("error_")} == {}  # no raw exception
    assert res["checked_blocks"] > 1000 and res["verified_blocks"] > 0  # hits were checked, the probe verified
    from bench.soak_faults import FAULTS

    kinds = set(FAULTS) - (set() if res["disk_tmpfs"] else {"disk_fill"})  # a tmpfs needs mount rights
    assert kinds <= set(res["faults"])  # every kind landed (they are dealt once per round)
    assert res["router_disagreed"] == {}  # the router, restarted at random, ends agreeing with engine 0
    assert res["counter_mismatches"] == 0
    assert "wrong bytes: 0" in out
