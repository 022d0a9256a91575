"""The connector hashes each block of a request once per role: an asynchronous save hands its
writer the keys it named the queued blocks with, and the scheduler's prefetch reuses the keys
its lookup hashed. Counted at `chain_hashes`, the one function that hashes blocks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvstore.hashing
import kvstore.keying
from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.scheduler_side import ConnectorScheduler
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.transfer_plan import BlockTransfer, GroupBlocks, StepPlan
from engine_adapter.vllm.worker_side import ConnectorWorker
from kvstore import KVCacheStore, StoreConfig
from tests.switches import need_vllm

LAYOUT = opaque_layout(1, 64, 4)


def _count_hashed_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of blocks each call of `chain_hashes` hashes (the real function runs)."""
    hashed: list[int] = []
    real: Callable[..., list[kvstore.hashing.BlockHash]] = kvstore.hashing.chain_hashes

    def counting(arr: np.ndarray, block_size: int, *args: object, **kwargs: object) -> list[kvstore.hashing.BlockHash]:
        hashed.append(len(arr) // block_size)
        return real(arr, block_size, *args, **kwargs)

    monkeypatch.setattr(kvstore.hashing, "chain_hashes", counting)
    monkeypatch.setattr(kvstore.keying, "chain_hashes", counting)
    return hashed


def test_an_asynchronous_save_hashes_each_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    config = StoreConfig(layout=LAYOUT, block_size=4, cpu_bytes=1 << 20)
    store = KVCacheStore(config)
    worker = ConnectorWorker(store, config, ["l0"], 8, ConnectorStats("worker", None))  # async saves
    layer = torch.arange(1, 9, dtype=torch.uint8).repeat_interleave(64).view(8, 64)  # engine block i holds i + 1
    worker.register_kv_caches({"l0": layer})
    tokens = np.arange(10, 34, dtype=np.uint32)  # 6 blocks, saved over two steps
    hashed = _count_hashed_blocks(monkeypatch)
    worker.save(StepPlan(saves=[BlockTransfer("r", tokens[:16], (GroupBlocks(0, (1, 2, 3, 4)),))]))
    worker.save(StepPlan(saves=[BlockTransfer("r", tokens, (GroupBlocks(4, (5, 6)),))]))
    worker.flush()
    assert sum(hashed) == 6
    monkeypatch.undo()
    out = [torch.zeros(LAYOUT.block_shape(4), dtype=torch.uint8) for _ in range(6)]
    assert store.blocks.load(store.keys(tokens), out).num_blocks == 6
    for i, block in enumerate(out):
        assert (block == i + 2).all()  # each under its own key: engine block i + 1
    store.close()


def test_the_schedulers_prefetch_takes_the_keys_its_lookup_hashed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    need_vllm()
    config = StoreConfig(layout=LAYOUT, block_size=4, cpu_bytes=4 * LAYOUT.block_bytes(4),
                         disk_path=str(tmp_path / "d"), disk_bytes=1 << 20, disk_sync=False)
    store = KVCacheStore(config)
    tokens = list(range(10, 42))  # 8 blocks into 4 CPU slots: the tail goes to disk
    store.blocks.save(store.keys(tokens), [torch.zeros(LAYOUT.block_shape(4), dtype=torch.uint8)] * 8)
    scheduler = ConnectorScheduler(store, 4, ConnectorStats("scheduler", None), async_loads=False)
    request = SimpleNamespace(request_id="r", all_token_ids=[*tokens, 7], prompt_embeds=None, cache_salt=None,
                              lora_request=None, mm_features=[])
    hashed = _count_hashed_blocks(monkeypatch)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)  # synchronous: prefetched
    deadline = time.monotonic() + 10
    while not store.prefetched_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.prefetched_blocks  # the prefetch ran
    assert sum(hashed) == 8  # the lookup's 8 blocks, none again for the prefetch
    store.close()
