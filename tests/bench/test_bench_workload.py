"""The workload benchmark at tiny size: its JSON, its hit rates, identical outputs; the workload shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import workload
from cli import main as kvstrata
from cli import output


def test_every_workload_at_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "RESULTS_DIR", tmp_path / "results")
    kvstrata.main(["bench", "workload", "--size", "tiny", "--workdir", str(tmp_path)])
    data = json.loads((tmp_path / "results" / "workload.json").read_text())
    assert data["size"] == "tiny" and set(data["workloads"]) == set(workload.WORKLOADS)
    for name, r in data["workloads"].items():
        assert r["outputs_identical"] and r["num_mismatched_outputs"] == 0, name
        assert 0 <= r["hit_rate"] <= r["findable_hit_rate"] <= 1, name
        assert all(0 <= v <= 1 for v in r["hit_rate_by_tier"].values()), name
        assert sum(r["cached_tokens_by_tier"].values()) == r["cached_tokens"] > 0, name  # all five share prefixes
        assert r["store_blocks"]["pool_blocks"] < r["store_blocks"]["working_set_blocks"], name
        for metric in ("ttft_s", "request_s"):
            for kind in ("cache", "baseline"):
                s = r[metric][kind]
                assert 0 < s["p50"] <= s["p90"] and s["mean"] > 0, (name, metric, kind)
    assert list(tmp_path.glob("kvstrata-workload-*")) == []  # disk tiers removed


def test_sharing_structure() -> None:
    p = workload.PRESETS["tiny"]
    rng = np.random.default_rng(0)
    gsp = workload.build("gsp", p["gsp"], rng, 4096)
    n_sys = p["gsp"]["system_len"]
    assert len(gsp) == p["gsp"]["num_groups"] * p["gsp"]["prompts_per_group"]
    assert len({tuple(r.tokens[:n_sys]) for r in gsp}) == p["gsp"]["num_groups"]
    ldqa = workload.build("long_doc_qa", p["long_doc_qa"], rng, 4096)
    docs = p["long_doc_qa"]["num_documents"]
    assert len(ldqa) == docs * (1 + p["long_doc_qa"]["repeat_count"])
    rounds = workload.build("multi_round", p["multi_round"], rng, 4096)
    sessions = workload.Sessions()
    first = sessions.prompt(rounds[0])
    sessions.record(rounds[0], first, [7, 7])
    again = next(r for r in rounds[1:] if r.session == rounds[0].session)
    assert sessions.prompt(again) == [*first, 7, 7, *again.tokens]  # history grows by prompt + answer


def test_bad_override_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"gsp\.nope"):
        workload.resolve_params("tiny", ["gsp.nope=3"])
    assert workload.main(["--size", "tiny", "--set", "gsp.nope=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gsp.nope" in err[0]
    assert workload.resolve_params("tiny", ["gsp.num_groups=3"])["gsp"]["num_groups"] == 3
