"""`engine_adapter.vllm.forward_timer`: the forward pass is timed wherever vLLM 0.32 calls the
connector's hooks around it (no vLLM needed: the hooks are called in vLLM's orders here)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine_adapter.vllm.forward_timer import ForwardTimer

FORWARD_S = 0.02  # the "forward pass" between the hooks
CONNECTOR_S = 0.3  # the connector's own work inside the step, left out of the forward's time


def _one_step(timer: ForwardTimer, *, loads_first: bool, finish_forward: bool = False) -> list[tuple[int, float]]:
    timer.begin()  # bind_connector_metadata
    if loads_first:  # a step with synchronous loads: start_load_kv before the forward
        with timer.loading():
            time.sleep(CONNECTOR_S)
    time.sleep(FORWARD_S)
    if finish_forward:  # the v2 GPU runner says when the forward ended; sampling follows
        timer.end()
        time.sleep(CONNECTOR_S)
    if not loads_first:  # no synchronous loads: start_load_kv right after the forward
        with timer.loading():
            time.sleep(CONNECTOR_S)
    timer.finish(1000)  # wait_for_save
    return timer.samples()


def test_loads_before_the_forward_pass_are_left_out() -> None:
    [(tokens, seconds)] = _one_step(ForwardTimer(), loads_first=True)
    assert tokens == 1000 and FORWARD_S <= seconds < CONNECTOR_S


def test_loads_started_after_the_forward_pass_do_not_hide_it() -> None:
    """vLLM 0.32 calls `start_load_kv` after the forward pass when a step has no synchronous
    loads; timing from there to `wait_for_save` measured almost nothing (a prefill rate of
    ~1e8 tokens/s), which made the load policy recompute every hit."""
    [(tokens, seconds)] = _one_step(ForwardTimer(), loads_first=False)
    assert tokens == 1000 and FORWARD_S <= seconds < CONNECTOR_S


def test_finish_forward_ends_the_forward_pass() -> None:
    [(_, seconds)] = _one_step(ForwardTimer(), loads_first=False, finish_forward=True)
    assert FORWARD_S <= seconds < CONNECTOR_S


def test_steps_without_prefill_or_without_a_bind_give_no_sample() -> None:
    timer = ForwardTimer()
    timer.begin()
    timer.finish(0)  # a decode-only step
    timer.finish(1000)  # no bind before it
    with timer.loading():  # outside a step: nothing to leave out
        pass
    assert timer.samples() == []


def test_the_worker_reports_the_forward_pass_of_a_step_whose_loads_run_after_it(tmp_path: Path) -> None:
    """The connector's worker, hooks called in vLLM 0.32's order for a step without
    synchronous loads: the prefill rate it reports is the forward pass's, not the gap
    between `start_load_kv` and `wait_for_save`."""
    from engine_adapter.vllm.paged_blocks import opaque_layout
    from engine_adapter.vllm.stats import ConnectorStats
    from engine_adapter.vllm.transfer_plan import StepPlan
    from engine_adapter.vllm.worker_side import ConnectorWorker
    from kvstore import KVCacheStore, StoreConfig

    layout = opaque_layout(1, 64, 4)
    config = StoreConfig(layout=layout, block_size=4, cpu_bytes=4 * layout.block_bytes(4), disk_path=None)
    with KVCacheStore(config) as store:
        worker = ConnectorWorker(store, config, ["l0"], 8, ConnectorStats("worker", None))
        worker.register_kv_caches({"l0": torch.zeros(8, 64, dtype=torch.uint8)})
        worker.step_begins()  # bind_connector_metadata
        time.sleep(FORWARD_S)  # the forward pass
        worker.load(StepPlan())  # start_load_kv, after the forward
        worker.save(StepPlan(num_prefill_tokens=1000))  # wait_for_save
        rate = store.load_policy.prefill_rate
        assert rate is not None and rate <= 1000 / FORWARD_S
        worker.flush()
