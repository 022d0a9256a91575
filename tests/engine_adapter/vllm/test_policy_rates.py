"""The load policy's rates from the workers to a scheduler in another process (policy_rates.py):
what a worker reports, how the scheduler merges tensor ranks, pipeline stages and its view of
the tiers, and the reports it refuses. No vLLM needed."""

from __future__ import annotations

import math

import pytest

from engine_adapter.vllm.policy_rates import MAX_REPORTS, RatesBook, TierShares, WorkerRates, worker_rates
from kvstore.load_policy import LoadPolicy
from tiers.keys import TierKind

BLOCK_BYTES = 32 * 1024
KNOWN = frozenset({"pool", "cpu", "disk", "remote"})
CPU, DISK, REMOTE = TierKind.CPU, TierKind.DISK, TierKind.REMOTE


def book(tp: int = 1, pp: int = 1) -> RatesBook:
    return RatesBook(tp, pp, BLOCK_BYTES, [DISK, REMOTE], KNOWN)


def test_a_worker_reports_its_policys_estimates_in_shared_units() -> None:
    policy = LoadPolicy("auto", 32, BLOCK_BYTES)
    shares = TierShares()
    assert worker_rates(policy, shares, 0, 0) == WorkerRates(0, 0, None, ())  # nothing measured yet
    policy.observe_prefill(1000, 0.01)  # 1e5 tokens/s
    policy.observe_load(DISK, BLOCK_BYTES, 0.1)  # a block in 0.1 s
    shares.add({DISK: 3})
    rates = worker_rates(policy, shares, 1, 2)
    assert (rates.pp_rank, rates.tp_rank) == (1, 2)
    assert rates.prefill_s_per_token == pytest.approx(1e-5)
    assert [(name, round(s, 6), share) for name, s, share in rates.tiers] == [("disk", 0.1, pytest.approx(0.9))]


def test_the_scheduler_adopts_the_reported_rates_and_decides_with_them() -> None:
    """A slow disk reported by the worker: the scheduler's policy, which measured nothing
    itself, recomputes a disk hit; a fast one it loads."""
    rates = book()
    scheduler = LoadPolicy("auto", 32, BLOCK_BYTES)
    assert scheduler.blocks_to_load([DISK] * 4) == 4  # no rates: everything is loaded
    slow = WorkerRates(0, 0, 1e-5, (("disk", 0.1, 1.0),))  # a block: 0.32 ms to recompute, 100 ms to load
    assert rates.take([slow]) and rates.apply(scheduler)
    assert scheduler.prefill_rate == pytest.approx(1e5)
    assert scheduler.bandwidth(DISK) == pytest.approx(BLOCK_BYTES / 0.1)
    assert scheduler.blocks_to_load([DISK] * 4) == 0
    assert not rates.take([slow])  # the same report again: nothing new
    fast = WorkerRates(0, 0, 1e-5, (("disk", 1e-5, 1.0),))
    assert rates.take([fast]) and rates.apply(scheduler)
    assert scheduler.blocks_to_load([DISK] * 4) == 4
    assert rates.rejected == 0


def test_tensor_ranks_merge_by_the_slowest_and_pipeline_stages_add_up() -> None:
    rates = book(tp=2, pp=2)
    rates.take([WorkerRates(0, 0, 1e-5, (("disk", 0.01, 1.0),)), WorkerRates(0, 1, 3e-5, (("disk", 0.04, 1.0),))])
    assert rates.prefill_rate() is None  # stage 1 has not reported: unknown, load everything
    rates.take([WorkerRates(1, 0, 2e-5, (("disk", 0.02, 1.0),))])
    assert rates.prefill_rate() == pytest.approx(1 / (3e-5 + 2e-5))  # slowest rank of each stage, stages in turn
    assert rates.bandwidths() == {DISK: pytest.approx(BLOCK_BYTES / 0.04)}  # the slowest worker's block


def test_a_worker_cpu_tier_counts_towards_the_scheduler_view_by_its_recent_share() -> None:
    """The scheduler's view has no CPU tier: a hit the worker serves from its CPU tier is one
    the scheduler sees on disk. Mostly CPU hits: the disk-seen hit costs mostly the CPU's time;
    a worker that never read its disk reports the CPU's alone."""
    rates = book()
    rates.take([WorkerRates(0, 0, 1e-5, (("cpu", 1e-5, 3.0), ("disk", 0.1, 1.0), ("remote", 0.2, 1.0)))])
    assert rates.bandwidths() == {DISK: pytest.approx(BLOCK_BYTES / ((3 * 1e-5 + 0.1) / 4)),
                                  REMOTE: pytest.approx(BLOCK_BYTES / 0.2)}
    rates.take([WorkerRates(0, 0, 1e-5, (("cpu", 1e-5, 1.0),))])
    assert rates.bandwidths() == {DISK: pytest.approx(BLOCK_BYTES / 1e-5)}


def test_tier_shares_follow_recent_loads() -> None:
    shares = TierShares()
    shares.add({CPU: 4})
    shares.add({})  # no load: no change
    assert shares.snapshot() == {CPU: pytest.approx(1.2)}
    for _ in range(30):
        shares.add({DISK: 4})
    snap = shares.snapshot()
    assert snap[DISK] == pytest.approx(4, rel=1e-3) and snap[CPU] < 1e-4


@pytest.mark.parametrize("bad", [
    WorkerRates(1, 0, 1e-5),  # a stage this engine does not have
    WorkerRates(0, -1, 1e-5),
    WorkerRates(0, 0, 0.0),  # no time
    WorkerRates(0, 0, -1e-5),
    WorkerRates(0, 0, math.nan),
    WorkerRates(0, 0, math.inf),
    WorkerRates(0, 0, 1e-12),  # 1e12 tokens/s: faster than any engine
    WorkerRates(0, 0, 1e-5, (("tape", 0.1, 1.0),)),  # a tier no one registered: never interned
    WorkerRates(0, 0, 1e-5, (("disk", 0.0, 1.0),)),
    WorkerRates(0, 0, 1e-5, (("disk", 1e-15, 1.0),)),  # beyond any memory's bandwidth
    WorkerRates(0, 0, 1e-5, (("disk", math.nan, 1.0),)),
    WorkerRates(0, 0, 1e-5, (("disk", 0.1, -1.0),)),
    WorkerRates(0, 0, 1e-5, (("disk", 0.1, math.inf),)),
    WorkerRates(0, 0, 1e-5, (("disk", 0.1, 1.0), ("disk", 0.2, 1.0))),  # a tier twice
    WorkerRates(0, 0, 1e-5, (("disk", 0.1),)),  # type: ignore[arg-type]
    WorkerRates(0, 0, 1e-5, [("disk", 0.1, 1.0)]),  # type: ignore[arg-type]
    WorkerRates(0, 0, "1e-5"),  # type: ignore[arg-type]
    WorkerRates(False, 0, 1e-5),  # a bool is no rank
    ("disk", 0.1),
])
def test_impossible_or_malformed_reports_are_counted_and_change_nothing(bad: object) -> None:
    rates = book()
    scheduler = LoadPolicy("auto", 32, BLOCK_BYTES)
    good = WorkerRates(0, 0, 1e-5, (("disk", 0.1, 1.0),))
    rates.take([good])
    rates.apply(scheduler)
    assert not rates.take([bad])
    assert rates.rejected == 1
    rates.apply(scheduler)
    assert scheduler.prefill_rate == pytest.approx(1e5)
    assert scheduler.bandwidth(DISK) == pytest.approx(BLOCK_BYTES / 0.1)
    assert "tape" not in {k.value for k in rates.bandwidths()}


def test_a_step_with_more_reports_than_any_engine_has_workers_is_refused_whole() -> None:
    rates = book()
    assert not rates.take([WorkerRates(0, 0, 1e-5)] * (MAX_REPORTS + 1))
    assert rates.rejected == 1 and rates.prefill_rate() is None


def test_adopt_refuses_impossible_rates_whole() -> None:
    policy = LoadPolicy("auto", 32, BLOCK_BYTES)
    assert policy.adopt(1e5, {DISK: 1e6})
    for prefill, bandwidths in [(math.nan, {}), (1e9, {}), (0.0, {}), (1e5, {DISK: math.inf}), (1e5, {DISK: 1e14}),
                                (1e5, {DISK: -1.0})]:
        assert not policy.adopt(prefill, bandwidths)
    assert policy.num_samples_rejected == 6
    assert policy.prefill_rate == 1e5 and policy.bandwidth(DISK) == 1e6
    assert policy.adopt(None, {})  # nothing known (yet): everything is loaded again
    assert policy.blocks_to_load([DISK] * 3) == 3
