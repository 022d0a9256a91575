"""The data path: batched copies (BlockBatch), prefetch from slow tiers, and the asyncio API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import InvalidTokensError, StoreClosedError
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.keys import TierKind
from tiers.shared.blockbatch import BlockBatch, block_rows, copy_rows


def test_block_rows_and_batched_copies_match_per_block_copies() -> None:
    kv = make_kv(10 * BLOCK)
    rows = block_rows(kv, BLOCK)
    batch = BlockBatch(rows)
    for i in range(10):
        assert torch.equal(batch[i], kv[:, :, i * BLOCK : (i + 1) * BLOCK])
    rev = batch[::-1]
    assert len(rev) == 10 and torch.equal(rev[0], batch[9]) and torch.equal(rev[9:2:-3][1], batch[3])
    assert torch.equal(batch.select([7, 2])[1], batch[2])
    slab = torch.zeros((16, *LAYOUT.block_shape(BLOCK)), dtype=LAYOUT.dtype)
    slots = [3, 4, 5, 11, 0, 1, 2, 9, 8, 7]  # runs forwards, a lone slot, a run backwards
    assert copy_rows(slab, slots, rows, list(range(10)))
    for i, slot in enumerate(slots):
        assert torch.equal(slab[slot], kv[:, :, i * BLOCK : (i + 1) * BLOCK])
    out = torch.zeros_like(kv)
    assert copy_rows(block_rows(out, BLOCK), list(range(10)), slab, slots)
    assert torch.equal(out, kv)
    assert not copy_rows(slab.to(torch.float32), [0], rows, [0])  # dtypes differ: nothing copied


def test_store_and_retrieve_through_batches_are_bit_exact(make_store) -> None:  # type: ignore[no-untyped-def]
    store = make_store(cpu_blocks=8)  # 12 blocks: 4 spill to disk
    tokens = list(range(12 * BLOCK + 3))
    kv = make_kv(len(tokens))
    assert store.store(tokens, kv) == 12 * BLOCK
    res = store.retrieve(tokens)
    assert res.num_tokens == 12 * BLOCK and torch.equal(res.kv, kv[:, :, : 12 * BLOCK])
    assert res.blocks_per_tier == {TierKind.CPU: 8, TierKind.DISK: 4}
    out = torch.full_like(kv, 7)
    res = store.retrieve(tokens, out=out)
    assert torch.equal(out[:, :, : 12 * BLOCK], kv[:, :, : 12 * BLOCK]) and (out[:, :, 12 * BLOCK :] == 7).all()
    store.check_integrity()


def _config(path: Path, **kw: object) -> StoreConfig:
    return StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=16 * LAYOUT.block_bytes(BLOCK), disk_path=str(path),
                       disk_bytes=16 << 20, disk_sync=False, **kw)  # type: ignore[arg-type]


def test_prefetch_brings_a_disk_prefix_into_memory(tmp_path: Path) -> None:
    tokens = list(range(10 * BLOCK))
    kv = make_kv(len(tokens))
    with KVCacheStore(_config(tmp_path / "d")) as store:
        store.store(tokens, kv)
    with KVCacheStore(_config(tmp_path / "d")) as store:  # reopened: everything on disk
        assert store.retrieve(tokens[:BLOCK]).blocks_per_tier == {TierKind.DISK: 1}  # block 0 now in memory too
        got = store.prefetch(tokens).result(timeout=30)
        assert (got.num_held, got.num_already, got.num_promoted, got.num_in_memory) == (10, 1, 9, 10), got
        assert sum(store.prefetched_blocks.values()) == 9
        res = store.retrieve(tokens)
        assert res.blocks_per_tier == {TierKind.CPU: 10} and torch.equal(res.kv, kv)
        assert store.prefetch(list(range(5000, 5000 + 3 * BLOCK))).result(timeout=30).num_in_memory == 0  # none cached
        with pytest.raises(InvalidTokensError):
            store.prefetch([1.5])  # bad input raises at once, not in the future
        store.check_integrity()


def test_asyncio_api_runs_many_calls_at_once_with_the_sync_semantics(tmp_path: Path) -> None:
    docs = [list(range(i * 1000, i * 1000 + 6 * BLOCK)) for i in range(8)]
    kvs = [make_kv(6 * BLOCK, seed=i) for i in range(8)]
    store = KVCacheStore(_config(tmp_path / "d", io_threads=3))

    async def main() -> None:
        stored = await asyncio.gather(*(store.astore(d, kv) for d, kv in zip(docs, kvs)))
        assert stored == [6 * BLOCK] * 8
        found = await asyncio.gather(*(store.alookup(d) for d in docs))
        assert found == [6 * BLOCK] * 8
        results = await asyncio.gather(*(store.aretrieve(d) for d in docs))
        for res, kv in zip(results, kvs):
            assert res.num_tokens == 6 * BLOCK and torch.equal(res.kv, kv)
        with pytest.raises(InvalidTokensError):
            await store.aretrieve("not tokens")

    asyncio.run(main())
    store.close()
    with pytest.raises(StoreClosedError):
        asyncio.run(store.alookup(docs[0]))


def test_load_policy_keeps_the_blocks_whose_loading_saves_time() -> None:
    from kvstore.load_policy import LoadPolicy

    cpu, disk, pool = TierKind.CPU, TierKind.DISK, TierKind.POOL
    policy = LoadPolicy("auto", block_size=16, block_bytes=1 << 20, free=frozenset({pool}))
    kinds = [pool, cpu, cpu, disk, disk, disk]
    assert policy.blocks_to_load(kinds) == 6  # nothing measured yet: load (and measure)
    policy.observe_prefill(16_000, 1.0)  # 1 ms to recompute a block
    policy.observe_load(cpu, 1 << 30, 0.1)  # 0.1 ms to load one
    policy.observe_load(disk, 1 << 20, 0.01)  # 10 ms to load one
    assert policy.blocks_to_load(kinds) == 3  # the disk blocks are recomputed
    policy.observe_load(disk, 100 << 20, 0.01)  # the disk got fast: the running average follows
    policy.observe_load(disk, 100 << 20, 0.01)
    policy.observe_load(disk, 100 << 20, 0.01)
    policy.observe_load(disk, 100 << 20, 0.01)
    policy.observe_load(disk, 100 << 20, 0.01)
    assert policy.blocks_to_load(kinds) == 6
    assert LoadPolicy("always", 16, 1 << 20).blocks_to_load(kinds) == 6
    assert LoadPolicy("never", 16, 1 << 20, free=frozenset({pool})).blocks_to_load(kinds) == 1  # the pool: free
    with pytest.raises(Exception, match="load_policy"):
        StoreConfig(LAYOUT, load_policy="sometimes")


def test_auto_recomputes_a_slow_disk_tail_with_the_same_answer() -> None:
    import json

    from bench.load_policy import run

    result = run(doc_tokens=256, disk_mbps=0.15, repeats=1)  # a margin that survives a busy machine
    trials = result["trials"]
    auto, always, never = trials["auto"][0], trials["always"][0], trials["never"][0]
    assert auto["tokens"] == always["tokens"] == never["tokens"]
    assert "disk" in always["by_tier"] and "disk" not in auto["by_tier"] and "cpu" in auto["by_tier"]
    assert never["by_tier"] == {} and never["computed"] > auto["computed"] > always["computed"]
    json.dumps(result, default=str)
