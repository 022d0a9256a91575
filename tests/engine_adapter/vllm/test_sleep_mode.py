"""vLLM's sleep mode on the connector's worker side, over a real store and real paged tensors:
once `unregister_kv_caches` returns, no copy touches vLLM's KV memory (a background load
still running fills nothing, a step's loads and saves are skipped and counted, skipped loads
are blocks vLLM recomputes); `restore_kv_caches` rebuilds the views and transfers work again.
Both are idempotent."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.transfer_plan import BlockTransfer, GroupBlocks, StepPlan
from engine_adapter.vllm.worker_side import ConnectorWorker
from kvstore import KVCacheStore, StoreConfig

LAYOUT = opaque_layout(1, 64, 4)
TOKENS = np.arange(10, 26, dtype=np.uint32)  # 4 blocks of 4 tokens


class Rig:
    """A store holding TOKENS' 4 blocks (block i filled with i + 1) and a worker over one
    layer of 8 engine blocks of 64 bytes (saves synchronous: counted when `save` returns)."""

    def __init__(self) -> None:
        self.config = StoreConfig(layout=LAYOUT, block_size=4, cpu_bytes=1 << 20)
        self.store = KVCacheStore(self.config)
        blocks = [torch.full(LAYOUT.block_shape(4), i + 1, dtype=torch.uint8) for i in range(4)]
        self.store.blocks.save(self.store.keys(TOKENS), blocks)
        self.layer = torch.zeros(8, 64, dtype=torch.uint8)
        self.stats = ConnectorStats("worker", None)
        self.worker = ConnectorWorker(self.store, self.config, ["l0"], 8, self.stats, async_saves=False)
        self.worker.register_kv_caches({"l0": self.layer})

    def counter(self, name: str) -> int:
        return self.stats.counters.get(name, 0)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.worker.flush()
    made.store.close()


def _load(req: str, ids: tuple[int, ...]) -> BlockTransfer:
    return BlockTransfer(req, TOKENS[: 4 * len(ids)], (GroupBlocks(0, ids),))


def test_asleep_no_copy_touches_vllms_memory_and_restored_it_works_again(rig: Rig) -> None:
    rig.worker.unregister_kv_caches()
    rig.worker.unregister_kv_caches()  # idempotent
    assert rig.worker.paged is None and rig.worker.asleep
    rig.layer.fill_(7)  # "freed": whatever is there now must stay untouched
    rig.worker.load(StepPlan(loads=[_load("a", (0, 1))]))  # would write blocks 0 and 1
    rig.worker.load(StepPlan(async_loads=[_load("b", (2, 3, 4))]))
    rig.worker.wait_for_loads(10)
    saved_before = rig.counter("save_blocks")
    rig.worker.save(StepPlan(saves=[BlockTransfer("c", TOKENS, (GroupBlocks(0, (5, 6, 7, 0)),))]))
    assert (rig.layer == 7).all()  # nothing read or written
    assert rig.counter("save_blocks") == saved_before
    assert rig.counter("sleep_skipped_blocks") == 2 + 3 + 4
    assert rig.worker.take_load_errors() == {0, 1, 2, 3, 4}  # vLLM recomputes them
    assert rig.worker.get_finished(set()) == (None, {"b"})  # the background load still ends
    rig.worker.restore_kv_caches()
    rig.worker.restore_kv_caches()  # idempotent
    assert not rig.worker.asleep and rig.worker.paged is not None
    rig.worker.load(StepPlan(loads=[_load("d", (3, 1))]))
    assert (rig.layer[3] == 1).all() and (rig.layer[1] == 2).all()
    assert rig.worker.take_load_errors() == set()


def test_a_background_load_running_at_sleep_writes_nothing(rig: Rig) -> None:
    gate, reading = threading.Event(), threading.Event()
    original = rig.store.blocks.load

    def slow_load(*args: object, **kwargs: object) -> object:
        reading.set()
        gate.wait(10)  # the read is on its way while vLLM goes to sleep
        return original(*args, **kwargs)  # type: ignore[arg-type]

    rig.store.blocks.load = slow_load  # type: ignore[method-assign,assignment]
    rig.worker.load(StepPlan(async_loads=[_load("r", (5, 6))]))
    assert reading.wait(10)
    rig.worker.unregister_kv_caches()
    gate.set()
    rig.worker.wait_for_loads(10)
    assert not rig.layer.any()  # the read ended after sleep: nothing scattered
    assert rig.worker.take_load_errors() == {5, 6}
    assert rig.worker.get_finished(set()) == (None, {"r"})
    assert rig.counter("sleep_skipped_blocks") == 2


def test_restore_without_unregister_changes_nothing(rig: Rig) -> None:
    paged = rig.worker.paged
    rig.worker.restore_kv_caches()
    assert rig.worker.paged is paged and not rig.worker.asleep
