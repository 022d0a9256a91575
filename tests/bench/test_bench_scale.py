"""`kvstrata bench scale-disk` and `kvstrata bench procs` end to end at tiny sizes: every
figure is in the JSON, each ratio is taken from figures of the same run, and nothing read
back was wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.scale import BATCH_BLOCKS, BLOCK, _fill
from bench.scale import _config as scale_config
from bench.scale_disk import _layout, _store, config
from cli import main as kvstrata
from cli.redis_servers import redis_binary
from kvstore import KVCacheStore


@pytest.mark.slow
def test_bench_scale_disk_writes_figures_and_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path / "results")
    work = tmp_path / "work"
    work.mkdir()
    rc = kvstrata.main(["bench", "scale-disk", "--blocks", "300", "--blocks", "600", "--payload-mib", "0.0625",
                        "--payload-blocks", "6", "--dir", str(work)])
    assert rc == 0, capsys.readouterr().out
    out = json.loads((tmp_path / "results" / "scale_disk.json").read_text())
    res = out["results"]
    assert set(res) == {"tiny/300", "tiny/600", "0.0625MiB/6"}
    small = res["tiny/300"]
    for r in res.values():
        n = r["blocks"]
        assert r["raw_keys"] == n  # the new process saw every block the fill stored
        assert r["newest_prompt_held_after_evicting"] is True  # evicting made room for all of it
        for key in ("store_ns_per_block", "lookup_hit_ns_per_block", "lookup_miss_ns_per_block",
                    "evict_store_ns_per_block", "open_s", "open_cpu_s", "raw_cursor_s", "lmdb_bytes_per_block",
                    "traced_bytes_per_block"):
            assert r[key] > 0, key
        assert r["open_vs_raw_cursor"] == pytest.approx(r["open_s"] / r["raw_cursor_s"])
        assert r["open_s_per_million"] == pytest.approx(r["open_s"] / n * 1e6)
        assert isinstance(r["goal_open_met"], bool) and isinstance(r["goal_index_bytes_met"], bool)
    big = res["tiny/600"]
    for key in ("store_ns_per_block", "evict_store_ns_per_block", "open_cpu_s_per_million"):
        assert big[f"{key}_vs_smallest"] == pytest.approx(big[key] / small[key])
    pay = res["0.0625MiB/6"]
    assert pay["block_bytes"] == 64 << 10 and pay["raw_write_gbps"] > 0
    assert pay["store_vs_raw_write"] == pytest.approx(pay["store_gbps"] / pay["raw_write_gbps"])
    assert list(work.iterdir()) == []  # every filled directory removed
    assert "open/raw cursor" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_bench_procs_writes_rates_and_ratios(tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    if tier == "redis":
        redis_binary()  # skips without redis-server (fails under KVSTRATA_TEST_REQUIRE_REDIS=1)
    monkeypatch.setattr("cli.output.RESULTS_DIR", tmp_path)
    rc = kvstrata.main(["bench", "procs", "--tier", tier, "--procs", "1", "--procs", "2", "--mib", "1",
                        "--block-kib", "64", "--lookups", "10"])
    assert rc == 0, capsys.readouterr().out
    out = json.loads((tmp_path / "procs.json").read_text())
    res = out["results"]
    assert set(res) == {f"{tier}/1", f"{tier}/2"}
    one = res[f"{tier}/1"]["tier"]["lookup_p99_us"]
    for n, r in ((1, res[f"{tier}/1"]), (2, res[f"{tier}/2"])):
        t, raw = r["tier"], r["raw"]
        assert r["processes"] == n and len(t["per_process_write_gbps"]) == n
        assert t["wrong"] == 0  # the checked prompts bit-exact
        assert t["short"] == 0 or t["faults"] > 0  # a prompt read back short only after a fault counted
        assert raw["short"] == 0
        for key in ("write_gbps", "read_gbps"):
            assert t[key] > 0 and raw[key] > 0, key
        assert r["write_vs_raw"] == pytest.approx(t["write_gbps"] / raw["write_gbps"])
        assert r["read_vs_raw"] == pytest.approx(t["read_gbps"] / raw["read_gbps"])
        assert 0 < t["lookup_p50_us"] <= t["lookup_p99_us"]
        assert r["lookup_p99_vs_one_process"] == pytest.approx(t["lookup_p99_us"] / one)
        assert out["burst_us"] <= raw["burst_p50_us"] <= raw["burst_p99_us"]  # a burst lasts at least its length
        assert r["lookup_p99_vs_burst"] == pytest.approx(t["lookup_p99_us"] / raw["burst_p99_us"])
        assert set(r["goals_met"]) == {"aggregate_vs_raw", "lookup_p99", "no_writer_starved"}
    printed = capsys.readouterr().out
    assert "p99 vs 1" in printed and "p99 vs burst" in printed


def test_scale_disk_times_lookups_on_a_whole_prompt(tmp_path: Path) -> None:
    """The fill stores the short prompt first: the last one, whose lookup the bench times per
    block, is a whole batch at any N (it was N mod the batch: 576 of 2,048 blocks at 10^6 and
    1,808 at 10^4, so a lookup's fixed costs weighed 3.1x more per block at 10^6)."""
    layout = _layout(0.0)
    kv = torch.zeros(layout.block_shape(2 * BLOCK), dtype=layout.dtype)
    with KVCacheStore(config(str(tmp_path), 5, 0.0)) as store:
        last = _store(store, 5, 2, kv, np.random.default_rng(0))[2]
        assert len(last) == 2 * BLOCK
        assert store.lookup(last) == len(last)


def test_scale_times_lookups_on_a_whole_prompt() -> None:
    """`bench scale`'s fill has the same order: its timed "32K-token prompt" was N mod 2,048
    blocks (1,808 at 10^4, 576 at 10^6), now whole."""
    with KVCacheStore(scale_config("pool", BATCH_BLOCKS + 1, "")) as store:
        last = _fill(store, BATCH_BLOCKS + 1, np.random.default_rng(0))[1]
        assert len(last) == BATCH_BLOCKS * BLOCK
        assert store.lookup(last) == len(last)
