"""The trace replay benchmark: its tier logic reproduces the analytic ceiling and orders configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import trace
from cli import output

TRACE = trace.DEFAULT_TRACE  # packaged with kvstrata: these tests never skip


def test_packaged_traces_are_the_published_ones() -> None:
    """The packaged gzip files hold the Mooncake traces, with their license and notice."""
    for name, first_ids in (("conversation_trace", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]),
                            ("synthetic_trace", None)):
        reqs = trace.load_trace(trace.TRACES_DIR / f"{name}.jsonl.gz")
        assert len(reqs) > 1000 and all(isinstance(i, int) for i in reqs[0])
        if first_ids is not None:
            assert reqs[0] == first_ids
    assert "Apache License" in (trace.TRACES_DIR / "LICENSE-APACHE").read_text()
    assert "Mooncake" in (trace.TRACES_DIR / "NOTICE").read_text()


def test_tokens_for_distinct_ids_give_distinct_blocks() -> None:
    a = trace.tokens_for([1, 2])
    b = trace.tokens_for([1, 3])
    assert len(a) == 1024 and (a[:512] == b[:512]).all() and not (a[512:] == b[512:]).all()


def test_infinite_hits_counts_leading_seen_blocks() -> None:
    reqs = [[1, 2, 3], [1, 2, 4], [5, 2], [1, 2, 3, 6]]
    assert trace.infinite_hits(reqs) == (2 + 0 + 3, 12)


def test_replay_with_unbounded_pool_equals_the_ceiling(tmp_path: Path) -> None:
    reqs = trace.load_trace(TRACE, limit=300)
    hits, refs = trace.infinite_hits(reqs)
    unique = len({i for ids in reqs for i in ids})
    res = trace.replay(reqs, unique + 1, 0, 0, tmp_path, "test")
    assert res["refs"] == refs
    assert res["hits_pool"] == hits  # the real pool, never evicting, finds exactly every prefix hit


def test_trace_benchmark_orders_configurations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(trace, "RESULTS_DIR", tmp_path)
    trace.main(["--trace", str(TRACE), "--limit", "400", "--fractions", "1/16"])
    data = json.loads((tmp_path / "trace_conversation_trace.json").read_text())
    row = data["rows"][0]
    assert 0 < row["gpu_only_hit_ratio"] < row["tiered_hit_ratio"] <= row["infinite_hit_ratio"] + 1e-12
    assert (tmp_path / "trace_conversation_trace.png").stat().st_size > 1000
