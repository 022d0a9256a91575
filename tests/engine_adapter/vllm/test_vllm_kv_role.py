"""vLLM's `kv_role` in a real vLLM: a `kv_producer` engine saves and never loads (its repeat
after a cache reset is recomputed), a `kv_consumer` engine on the same disk loads what the
producer saved (same output) and never saves (a new prompt leaves nothing on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


def test_a_producer_never_loads_and_a_consumer_never_saves(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    shared, fresh = prompt(1, 6 * BLOCK + 5), prompt(2, 4 * BLOCK + 5)
    producer = run_scenario({
        "model": model, "prompts": [shared], "rounds": 2, "reset_between": True, "connector_role": "kv_producer",
        "connector": connector_config(tmp_path / "p", load_policy="always", disk_path=str(tmp_path / "kv"))})
    first, repeat = (r[0] for r in producer["rounds"])
    assert repeat["num_cached_tokens"] == 0 and repeat["output"] == first["output"]  # recomputed
    assert stat_sum(producer["stats"], "save_new_blocks") == 6
    assert stat_sum(producer["stats"], "hit_tokens") == 0
    consumer = run_scenario({
        "model": model, "prompts": [shared, fresh], "rounds": 1, "connector_role": "kv_consumer",
        "connector": connector_config(tmp_path / "c", load_policy="always", disk_path=str(tmp_path / "kv"))})
    served = consumer["rounds"][0][0]
    assert served["num_cached_tokens"] == 6 * BLOCK and served["output"] == first["output"]
    assert stat_sum(consumer["stats"], "save_blocks") == 0  # the new prompt's blocks stay vLLM's
    assert stat_sum(consumer["stats"], "hit_tokens") == 6 * BLOCK
