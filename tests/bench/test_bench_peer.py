"""`kvstrata bench peer`: runs here without LMCache (the kvstrata and raw sides), its
kvstrata side survives a restart, and its remote rows run the remote tier against a
redis-server the bench starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import peer
from cli import main as kvstrata
from cli import output


@pytest.fixture
def results_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(output, "RESULTS_DIR", tmp_path / "results")
    return tmp_path / "results"


def test_peer_without_lmcache_runs_the_kvstrata_side(results_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    if peer.lmcache_python(None) is not None:
        pytest.skip("LMCache is importable here: the full comparison would run")
    assert kvstrata.main(["bench", "peer", "--prompts", "1", "--prompt-tokens", "256", "--lookup-tokens", "256",
                          "--rounds", "1", "--workdir", str(tmp_path), "--remote-mib", "32"]) == 0
    out = capsys.readouterr().out
    assert "LMCache is not installed here" in out and "remote read 32M values" in out
    assert "remote read 256K values, block API" in out  # the engine API's rows, contiguous blocks
    data = json.loads((results_dir / "peer.json").read_text())
    side = data["results"]["kvstrata"][0]
    assert side["restart_hit_tokens"] == 256 and side["write_s"] > 0 and side["lookup_256_us"] > 0
    assert "lmcache" not in data["results"]
    remote = data["remote"]["results"]  # the remote tier against a redis-server the bench started
    assert set(remote) == {"kvstrata", "minimal"} and set(remote["kvstrata"]) == {"256K", "2M", "32M"}
    assert all(r[0]["bytes"] == 32 << 20 and r[0]["read_s"] > 0 for r in remote["minimal"].values())  # the floor
    assert all(r[0]["bytes"] == 32 << 20 and r[0]["write_s"] > 0 and r[0]["read_s"] > 0
               and r[0]["blocks_write_s"] > 0 and r[0]["blocks_read_s"] > 0 for r in remote["kvstrata"].values())


def test_peer_refuses_bad_token_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvstrata.main(["bench", "peer", "--prompt-tokens", "300"]) == 2
    assert "multiples of 256" in capsys.readouterr().err
