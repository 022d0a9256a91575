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


def test_the_handoff_a_producer_offers_is_waited_for_by_a_consumer(tmp_path: Path) -> None:
    """The producer answers with the blocks it saved (`kv_transfer_params`); a consumer given
    them is served those blocks; a consumer promised blocks no store holds waits (vLLM asks
    again each step) until the handoff's wait runs out, counts it, and computes the prompt."""
    model = build_tiny_llama(tmp_path / "model")
    tokens, other, third = prompt(3, 6 * BLOCK + 5), prompt(4, 6 * BLOCK + 5), prompt(5, 6 * BLOCK + 5)
    kv = str(tmp_path / "kv")
    produced = run_scenario({
        "model": model, "prompts": [tokens], "max_tokens": 1, "connector_role": "kv_producer",
        "connector": connector_config(tmp_path / "p", load_policy="always", disk_path=kv)})["rounds"][0][0]
    assert produced["kv_transfer_params"] == {"kvstrata": {"blocks": 6}}
    consumer = run_scenario({
        "model": model, "connector_role": "kv_consumer", "rounds": 1,
        "prompts": [{"ids": tokens, "kv_transfer_params": produced["kv_transfer_params"]},
                    {"ids": other, "kv_transfer_params": {"kvstrata": {"blocks": 6}}},  # never produced
                    {"ids": third, "kv_transfer_params": {"kvstrata": {"blocks": "all"}}}],  # malformed
        "connector": connector_config(tmp_path / "c", load_policy="always", disk_path=kv)})
    served, waited, malformed = consumer["rounds"][0]
    assert served["num_cached_tokens"] == 6 * BLOCK and served["output"][0] == produced["output"][0]
    assert waited["num_cached_tokens"] == 0 and waited["seconds"] >= 5  # waited, then computed it
    assert malformed["num_cached_tokens"] == 0  # not waited for: counted below, not timed out
    stats = consumer["stats"]
    assert stat_sum(stats, "handoff_timeouts") == 1 and stat_sum(stats, "handoff_params_rejected") == 1
    assert consumer["rounds"][0][0]["kv_transfer_params"] is None  # a consumer offers nothing


def test_prefill_and_decode_engines_hand_off_through_a_real_redis_server(tmp_path: Path) -> None:
    """Disaggregated prefill/decode through the remote tier: the producer (its own disk) saves a
    long prompt to a real `redis-server` and offers its blocks; the consumer (another disk,
    the same server) is served them and computes only what follows. Prints the consumer's time
    for the handed-off prompt against the same engine computing a prompt of the same length."""
    from tests.redis_fixtures import redis_server

    model = build_tiny_llama(tmp_path / "model")
    handed, warm, fresh = prompt(6, 31 * BLOCK + 5), prompt(7, 31 * BLOCK + 5), prompt(8, 31 * BLOCK + 5)
    with redis_server() as server:
        produced = run_scenario({
            "model": model, "prompts": [handed], "max_tokens": 1, "connector_role": "kv_producer",
            "connector": connector_config(tmp_path / "p", load_policy="always", cpu_bytes=0,
                                          remote_url=server.url)})["rounds"][0][0]
        assert produced["kv_transfer_params"] == {"kvstrata": {"blocks": 31}}
        consumer = run_scenario({
            "model": model, "connector_role": "kv_consumer", "rounds": 1, "max_tokens": 1,
            "prompts": [warm, {"ids": handed, "kv_transfer_params": produced["kv_transfer_params"]}, fresh],
            "connector": connector_config(tmp_path / "c", load_policy="always", cpu_bytes=0,
                                          remote_url=server.url)})
    _, served, computed = consumer["rounds"][0]  # the first warms the engine up
    assert served["num_cached_tokens"] == 31 * BLOCK and served["output"] == produced["output"]
    assert computed["num_cached_tokens"] == 0
    assert stat_sum(consumer["stats"], "load_tokens_remote") == 31 * BLOCK  # from the server, not a disk
    assert stat_sum(consumer["stats"], "handoff_timeouts") == 0
    print(f"\nconsumer TTFT, {len(handed)}-token prompt: handed off {served['seconds'] * 1e3:.0f} ms, "
          f"computed {computed['seconds'] * 1e3:.0f} ms")
