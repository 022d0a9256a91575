"""The `kvstrata` command, the store demo and the first benchmarks, run at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import hashing
from cli import main as kvstrata
from cli import output


@pytest.fixture(autouse=True)
def results_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(output, "RESULTS_DIR", tmp_path / "results")
    return tmp_path / "results"


def test_demo_store_runs_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvstrata.main(["demo-store", "--tokens", "1024", "--layers", "1", "--cpu-mib", "1",
                        "--disk-path", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "retrieve after reopen" in out and " NO" not in out
    assert out.count("yes") == 3


def test_bench_hashing_writes_results(results_dir: Path) -> None:
    kvstrata.main(["bench", "hashing", "--tokens", "2048", "--repeat", "1"])
    data = json.loads((results_dir / "hashing.json").read_text())
    rows = data["rows"]
    assert {r["algo"] for r in rows} == {"xxh3_128", "sha256"}
    assert all(r["ns_per_token"] > 0 and r["speedup_vs_vllm"] > 0 for r in rows)


def test_vllm_reference_chain_matches_its_definition() -> None:
    import hashlib
    import pickle

    toks = list(range(32))
    chain = hashing.vllm_reference_chain(toks, 16)
    h0 = hashlib.sha256(pickle.dumps((hashlib.sha256(b"vllm-none-hash").digest(), tuple(range(16)), None),
                                     protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert chain[0] == h0 and len(chain) == 2


def test_bench_tiers_writes_ratios(results_dir: Path, tmp_path: Path) -> None:
    kvstrata.main(["bench", "tiers", "--mib", "1", "--sizes", "16K", "--repeat", "1", "--workdir", str(tmp_path),
                   "--lookup-tokens", "256", "--long-tokens", "256"])
    data = json.loads((results_dir / "tiers.json").read_text())
    r = data["sizes"]["16K"]
    for k in ("memcpy_gbps", "cpu_store_gbps", "cpu_retrieve_gbps", "disk_fill_commit_gbps", "disk_reuse_none_gbps",
              "disk_read_cold_gbps", "raw_fill_commit_gbps", "disk_reuse_none_ratio"):
        assert r[k] > 0, k
    assert data["lookup"]["256"]["lookup_us"] > 0
    assert data["long"]["256"]["disk_retrieve_vs_out"] > 0


def test_runner_demo_serves_every_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvstrata.main(["demo", "--doc-tokens", "512", "--question-tokens", "8", "--disk-path", str(tmp_path / "d")])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = {line.strip().split("  ")[0]: line for line in out.splitlines() if line.strip().startswith("Q")}
    assert "recompute" in lines["Q1 (first sight)"]
    assert " pool " in lines["Q2"]
    assert " disk " in lines["Q5 (after restart)"]
    assert out.count(" yes") == 5 and " NO" not in out
    for line in lines.values():  # TTFT is shown split: load + compute (each rounded to a ms)
        load, compute, ttft = (int(x) for x in line.split()[-6:-3])
        assert compute > 0 and load >= 0 and abs(load + compute - ttft) <= 1, line
    assert "TTFT = load + compute" in out


def test_bench_router_measures_memory_and_lookups(results_dir: Path) -> None:
    assert kvstrata.main(["bench", "router", "--blocks", "5000", "--instances", "3", "--lookups", "50",
                          "--http-lookups", "20", "--query-tokens", "256"]) == 0
    data = json.loads((results_dir / "router.json").read_text())
    assert data["memory"]["shared"]["entries"] == 5000 and data["memory"]["disjoint"]["entries"] == 15000
    lookup = data["lookup"]["lookup (validate + hash + match + score)"]
    assert 0 < lookup["median_us"] <= lookup["p99_us"]
    assert data["http"]["server_median_us"] > 0 and data["http"]["client_median_us"] > data["http"]["server_median_us"]
