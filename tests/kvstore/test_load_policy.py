"""`kvstore.load_policy.LoadPolicy` on its own: impossible samples are rejected, and a tier the
policy stopped loading from is probed again (no engine, no store)."""

from __future__ import annotations

import re

import pytest

from kvstore.errors import ConfigError
from kvstore.load_policy import MAX_LOAD_BANDWIDTH, MAX_PREFILL_RATE, LoadPolicy
from tiers.keys import TierKind

CPU, DISK = TierKind.CPU, TierKind.DISK
BLOCK_TOKENS, BLOCK_BYTES = 32, 1 << 20


def _policy(probe_every: int = 4) -> LoadPolicy:
    return LoadPolicy("auto", BLOCK_TOKENS, BLOCK_BYTES, probe_every=probe_every)


def test_a_prefill_faster_than_any_engine_is_rejected_and_counted() -> None:
    """The sample vLLM 0.32 produced when the forward pass was timed from a `start_load_kv`
    that ran after it: 1000 tokens in 5 microseconds. Averaged in, it made every load look
    slower than recomputing."""
    policy = _policy()
    assert policy.observe_prefill(1000, 5e-6) is False
    assert policy.observe_prefill(1000, 0.0) is False
    assert policy.observe_prefill(1000, -1.0) is False
    assert policy.prefill_rate is None and policy.num_samples_rejected == 3
    assert policy.blocks_to_load([CPU] * 8) == 8  # still unknown: load (and measure)
    assert policy.observe_prefill(1000, 0.1) is True  # 10k tokens/s: a CPU forward pass
    assert policy.prefill_rate == pytest.approx(1e4)
    assert policy.observe_prefill(1000, 1000 / (2 * MAX_PREFILL_RATE)) is False  # the estimate is kept
    assert policy.prefill_rate == pytest.approx(1e4) and policy.num_samples_rejected == 4
    assert policy.observe_prefill(0, 1.0) is False and policy.num_samples_rejected == 4  # nothing to time


def test_an_impossible_load_bandwidth_is_rejected_and_counted() -> None:
    policy = _policy()
    policy.observe_load(CPU, BLOCK_BYTES, BLOCK_BYTES / (2 * MAX_LOAD_BANDWIDTH))
    policy.observe_load(CPU, BLOCK_BYTES, 0.0)
    assert policy.bandwidth(CPU) is None and policy.num_samples_rejected == 2
    policy.observe_load(CPU, BLOCK_BYTES, 1e-4)  # 10 GB/s
    assert policy.bandwidth(CPU) == pytest.approx(BLOCK_BYTES / 1e-4)


def test_a_tier_the_policy_stopped_loading_from_is_probed_again() -> None:
    """Recomputing is measured faster than loading from disk: the policy recomputes the disk
    blocks, but every `probe_every`-th such decision loads them all (a probe), so the disk's
    bandwidth is measured again; once it is fast, the policy loads from it again."""
    policy = _policy(probe_every=4)
    policy.observe_prefill(32_000, 1.0)  # 1 ms to recompute a block
    policy.observe_load(CPU, BLOCK_BYTES, 1e-4)  # 0.1 ms to load one
    policy.observe_load(DISK, BLOCK_BYTES, 1e-2)  # 10 ms to load one
    kinds = [CPU, CPU, DISK, DISK]
    answers = [policy.blocks_to_load(kinds) for _ in range(8)]
    assert answers == [2, 2, 2, 4, 2, 2, 2, 4]
    assert policy.num_probes == 2
    assert policy.num_blocks_skipped == 6 * 2  # the probes skipped nothing
    for _ in range(5):  # the probe's loads find the disk fast now (a warm page cache)
        policy.observe_load(DISK, BLOCK_BYTES, 1e-5)
    assert policy.blocks_to_load(kinds) == 4
    assert policy.num_probes == 2  # loading everything anyway is not a probe


def test_decisions_that_load_everything_never_count_towards_a_probe() -> None:
    policy = _policy(probe_every=2)
    policy.observe_prefill(32, 1.0)  # recomputing is slow: everything is worth loading
    policy.observe_load(DISK, BLOCK_BYTES, 1e-2)
    for _ in range(10):
        assert policy.blocks_to_load([DISK] * 3) == 3
    assert policy.num_probes == 0 and policy.num_blocks_skipped == 0


def test_fixed_modes_neither_measure_nor_probe() -> None:
    for mode, expected in (("always", 2), ("never", 0)):
        policy = LoadPolicy(mode, BLOCK_TOKENS, BLOCK_BYTES, probe_every=1)
        policy.observe_prefill(32_000_000, 1.0)
        policy.observe_load(DISK, BLOCK_BYTES, 1.0)
        assert [policy.blocks_to_load([DISK, DISK]) for _ in range(3)] == [expected] * 3
        assert policy.num_probes == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_a_bad_probe_interval_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"probe_every must be an int >= 1, got {bad!r}")):
        LoadPolicy("auto", BLOCK_TOKENS, BLOCK_BYTES, probe_every=bad)  # type: ignore[arg-type]
