"""`prefetch` on real tiers: the real disk tier (LMDB) and a real `redis-server`.

After a prefetch, a retrieve finds the blocks in the CPU tier with the bytes stored; the
result says what was there, moved, missing or cut; the work is bounded (a cap per call,
the CPU tier's room beside retained blocks, a bound on waiting prefetches: one more is
dropped and counted); a fault while reading is a counted miss, never wrong bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import (
    MAX_PREFETCH_BLOCKS,
    InvalidInputError,
    KVCacheStore,
    PrefetchResult,
    PrefetchStatus,
    StoreConfig,
)
from kvstore.metrics import register_metrics
from kvstore.prefetch import PREFETCH_QUEUE_PER_THREAD
from tests.conftest import BLOCK, LAYOUT, make_kv
from tests.kvstore.test_store_background import DiskGate
from tests.redis_fixtures import RedisServer, redis_server
from tiers.keys import TierKind

WAIT_S = 30.0


def _config(**kw: object) -> StoreConfig:
    base: dict[str, object] = {"layout": LAYOUT, "block_size": BLOCK, "cpu_bytes": 16 * LAYOUT.block_bytes(BLOCK),
                               "disk_bytes": 16 << 20, "disk_sync": False}
    base.update(kw)
    return StoreConfig(**base)  # type: ignore[arg-type]


def _bits(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.view(torch.int16)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def _on_disk(path: Path, tokens: list[int], kv: torch.Tensor, **kw: object) -> KVCacheStore:
    """A store whose disk holds `tokens` (KV `kv`) and whose CPU tier is empty."""
    with KVCacheStore(_config(disk_path=str(path), **kw)) as first:
        first.store(tokens, kv)
    return KVCacheStore(_config(disk_path=str(path), **kw))


def test_prefetch_from_disk_then_retrieve_reads_the_cpu_tier(tmp_path: Path) -> None:
    tokens = list(range(6 * BLOCK))
    kv = make_kv(len(tokens), seed=1)
    with _on_disk(tmp_path / "d", tokens, kv) as store:
        assert store.locate(tokens) == [TierKind.DISK] * 6
        asked = tokens + list(range(9000, 9000 + 2 * BLOCK))  # two blocks no tier holds
        result = store.prefetch(asked).result(WAIT_S)
        assert result == PrefetchResult(PrefetchStatus.DONE, num_held=6, num_already=0, num_promoted=6,
                                        num_in_memory=6)
        assert store.locate(tokens) == [TierKind.CPU] * 6
        hits_before = {t.kind: t.num_hits for t in store.stats().tiers}
        got = store.retrieve(tokens)
        assert got.blocks_per_tier == {TierKind.CPU: 6} and torch.equal(_bits(got.kv), _bits(kv))
        hits = {t.kind: t.num_hits - hits_before[t.kind] for t in store.stats().tiers}
        assert hits == {TierKind.CPU: 6, TierKind.DISK: 0}
        again = store.prefetch(tokens).result(WAIT_S)  # held in memory already: nothing moves
        assert (again.num_already, again.num_promoted, again.num_in_memory) == (6, 0, 6)
        stats = store.stats()
        assert (stats.num_prefetch_calls, stats.num_prefetch_promoted, stats.num_prefetch_failed,
                stats.num_prefetch_dropped) == (2, 6, 0, 0)
        assert store.prefetched_blocks == {TierKind.DISK: 6}
        store.check_integrity()
        prometheus_client = pytest.importorskip("prometheus_client")
        registry = prometheus_client.CollectorRegistry()
        register_metrics(store, registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert re.search(r"kvstrata_prefetch_promoted_blocks_total{[^}]*} 6.0", text), text


def test_prefetch_from_a_real_redis_server_then_retrieve_reads_the_cpu_tier(server: RedisServer) -> None:
    tokens = list(range(100, 100 + 5 * BLOCK))
    kv = make_kv(len(tokens), seed=2)
    config = _config(remote_url=server.url, namespace="prefetch-remote")
    with KVCacheStore(config) as writer:
        writer.store(tokens, kv)
        assert writer.flush()
    with KVCacheStore(config) as store:  # another host's view: the remote tier only
        assert store.locate(tokens) == [TierKind.REMOTE] * 5
        result = store.prefetch(tokens).result(WAIT_S)
        assert (result.status, result.num_promoted, result.num_in_memory) == (PrefetchStatus.DONE, 5, 5)
        got = store.retrieve(tokens)
        assert got.blocks_per_tier == {TierKind.CPU: 5} and torch.equal(_bits(got.kv), _bits(kv))
        assert store.prefetched_blocks == {TierKind.REMOTE: 5}
        # Another tenant's (salt's) keys find nothing of it, and nothing wrong.
        from kvstore import ExtraKeys
        other = store.prefetch(tokens, extra_keys=ExtraKeys(cache_salt="other")).result(WAIT_S)
        assert (other.num_held, other.num_promoted, other.num_in_memory) == (0, 0, 0)


def test_a_fault_while_reading_is_a_counted_miss(server: RedisServer) -> None:
    """The server dies between the plan and the read: no block moves, each planned one is
    counted failed, the future resolves (never raises), and nothing wrong is retrieved."""
    tokens = list(range(300, 300 + 4 * BLOCK))
    config = _config(remote_url=server.url, namespace="prefetch-fault", remote_timeout_s=0.5)
    with KVCacheStore(config) as writer:
        writer.store(tokens, make_kv(len(tokens), seed=3))
        assert writer.flush()
    with KVCacheStore(config) as store:
        gate = DiskGate(store, before=True)  # the remote tier is the last one here
        future = store.prefetch(tokens)
        assert gate.entered.wait(WAIT_S)
        server.kill()
        gate.release()
        result = future.result(WAIT_S)
        assert (result.status, result.num_held, result.num_promoted, result.num_failed) == \
            (PrefetchStatus.DONE, 4, 0, 4)
        assert store.stats().num_prefetch_failed == 4
        assert store.retrieve(tokens).num_tokens == 0


def test_a_full_queue_drops_and_counts_the_next_prefetch(tmp_path: Path) -> None:
    tokens = list(range(4 * BLOCK))
    with _on_disk(tmp_path / "d", tokens, make_kv(len(tokens), seed=4), io_threads=1) as store:
        gate = DiskGate(store)  # holds the first prefetch in its read: the one I/O thread is busy
        limit = PREFETCH_QUEUE_PER_THREAD
        futures = [store.prefetch(tokens)]
        assert gate.entered.wait(WAIT_S)
        futures += [store.prefetch(tokens) for _ in range(limit - 1)]  # fill the queue
        dropped = store.prefetch(tokens)
        assert dropped.done() and dropped.result() == PrefetchResult(PrefetchStatus.DROPPED)
        assert store.stats().num_prefetch_dropped == 1
        gate.release()
        results = [f.result(WAIT_S) for f in futures]
        assert all(r.status is PrefetchStatus.DONE and r.num_in_memory == 4 for r in results)
        assert sum(r.num_promoted for r in results) == 4  # the first moved them; the rest found them
        assert store.prefetch(tokens).result(WAIT_S).status is PrefetchStatus.DONE  # room again
        stats = store.stats()
        assert (stats.num_prefetch_calls, stats.num_prefetch_dropped) == (limit + 2, 1)


def test_a_prefetch_the_caller_cancels_while_queued_gives_its_place_back(tmp_path: Path) -> None:
    tokens = list(range(4 * BLOCK))
    with _on_disk(tmp_path / "d", tokens, make_kv(len(tokens), seed=4), io_threads=1) as store:
        gate = DiskGate(store)
        running = store.prefetch(tokens)
        assert gate.entered.wait(WAIT_S)
        queued = [store.prefetch(tokens) for _ in range(PREFETCH_QUEUE_PER_THREAD - 1)]
        assert all(f.cancel() for f in queued)  # never run: each gives its place back
        more = [store.prefetch(tokens) for _ in range(PREFETCH_QUEUE_PER_THREAD - 1)]
        gate.release()
        assert all(f.result(WAIT_S).status is PrefetchStatus.DONE for f in [running, *more])
        assert store.stats().num_prefetch_dropped == 0


def test_work_is_bounded_by_the_cap_and_the_cpu_tiers_room_beside_retained_blocks(tmp_path: Path) -> None:
    """`max_blocks` cuts the keys looked at; the CPU tier (8 blocks, 4 retained) takes only
    what fits beside its retained blocks, which stay; a bad cap is one clear error."""
    cpu_blocks = 8
    long = list(range(10 * BLOCK))
    kv = make_kv(len(long), seed=5)
    kw = {"cpu_bytes": cpu_blocks * LAYOUT.block_bytes(BLOCK), "retain_share": 1.0}
    with _on_disk(tmp_path / "d", long, kv, **kw) as store:
        capped = store.prefetch(long, max_blocks=3).result(WAIT_S)
        assert (capped.num_capped, capped.num_held, capped.num_promoted, capped.num_in_memory) == (7, 3, 3, 3)
        session = list(range(5000, 5000 + 4 * BLOCK))
        store.store(session, make_kv(len(session), seed=6))
        assert store.retain(session, 600).num_retained == 4
        result = store.prefetch(long).result(WAIT_S)  # 3 in memory already, 4 retained: room for 1
        assert (result.num_held, result.num_already, result.num_promoted, result.num_unfit) == (10, 3, 1, 6)
        assert result.num_in_memory == 4
        assert store.locate(session) == [TierKind.CPU] * 4  # the retained blocks stayed
        got = store.retrieve(long)
        assert got.num_tokens == len(long) and torch.equal(_bits(got.kv), _bits(kv))  # the rest from disk
        for bad in (0, -1, MAX_PREFETCH_BLOCKS + 1, 2.0, True, "3"):
            with pytest.raises(InvalidInputError, match="max_blocks"):
                store.prefetch(long, max_blocks=bad)  # type: ignore[arg-type]
        assert store.stats().num_prefetch_calls == 2  # refused calls counted nothing


def test_a_block_verify_removes_during_a_prefetchs_read_is_not_inserted(tmp_path: Path) -> None:
    """The disk holds another prefix's KV under these keys; a prefetch has read it (without
    the lock) when verify finds it wrong and removes it everywhere: the prefetch inserts
    nothing, so the wrong block never comes back in the CPU tier."""
    tokens = list(range(4 * BLOCK))
    right, wrong = make_kv(len(tokens), seed=7), make_kv(len(tokens), seed=8)
    with _on_disk(tmp_path / "d", tokens, wrong) as store:
        gate = DiskGate(store)  # the prefetch's read returns, its insert waits
        future = store.prefetch(tokens)
        assert gate.entered.wait(WAIT_S)
        verified = store.verify(tokens, right)
        assert sum(len(i) for i in verified.mismatches.values()) == 4
        assert store.lookup(tokens) == 0
        gate.release()
        result = future.result(WAIT_S)
        assert (result.status, result.num_promoted, result.num_in_memory) == (PrefetchStatus.QUARANTINED, 0, 0)
        assert store.lookup(tokens) == 0  # not back in the CPU tier
        assert store.retrieve(tokens).num_tokens == 0


def test_running_prefetches_share_the_cpu_tiers_room(tmp_path: Path) -> None:
    """Two prefixes, each as large as the CPU tier, wait on disk; while the first prefetch
    reads, the second finds the room planned by it (not free room): it reads nothing, so
    the buffers of running prefetches never exceed the tier's room and the first one's
    blocks are not pushed out by the second's insert."""
    first, second = list(range(4 * BLOCK)), list(range(7000, 7000 + 4 * BLOCK))
    kv_first, kv_second = make_kv(len(first), seed=9), make_kv(len(second), seed=10)
    kw = {"cpu_bytes": 4 * LAYOUT.block_bytes(BLOCK), "io_threads": 2}
    with KVCacheStore(_config(disk_path=str(tmp_path / "d"), **kw)) as writer:
        writer.store(first, kv_first)
        writer.store(second, kv_second)
    with KVCacheStore(_config(disk_path=str(tmp_path / "d"), **kw)) as store:
        assert store.locate(first) == store.locate(second) == [TierKind.DISK] * 4
        gate = DiskGate(store)  # the first prefetch has read its 4 blocks; its insert waits
        running = store.prefetch(first)
        assert gate.entered.wait(WAIT_S)
        later = store.prefetch(second).result(WAIT_S)
        assert (later.status, later.num_held, later.num_unfit, later.num_promoted) == (PrefetchStatus.DONE, 4, 4, 0)
        gate.release()
        done = running.result(WAIT_S)
        assert (done.num_promoted, done.num_in_memory) == (4, 4)
        assert store.locate(first) == [TierKind.CPU] * 4
        got = store.retrieve(first)
        assert torch.equal(_bits(got.kv), _bits(kv_first))
        after = store.prefetch(second).result(WAIT_S)  # room planned by nobody now: it runs
        assert (after.num_promoted, after.num_unfit) == (4, 0)


def test_a_prefetch_skips_the_blocks_another_running_prefetch_reads(tmp_path: Path) -> None:
    """While a prefetch of a prefix reads, a prefetch of a longer prompt with that prefix
    reads only its own blocks: the others are counted in flight (not unfit, not read twice),
    and every block reaches the CPU tier once both end."""
    tokens = list(range(6 * BLOCK))
    kv = make_kv(len(tokens), seed=11)
    kw = {"cpu_bytes": 8 * LAYOUT.block_bytes(BLOCK), "io_threads": 2}
    with KVCacheStore(_config(disk_path=str(tmp_path / "d"), **kw)) as writer:
        writer.store(tokens, kv)
    with KVCacheStore(_config(disk_path=str(tmp_path / "d"), **kw)) as store:
        assert store.locate(tokens) == [TierKind.DISK] * 6
        gate = DiskGate(store)  # the first prefetch has read its 4 blocks; its insert waits
        running = store.prefetch(tokens[:4 * BLOCK])
        assert gate.entered.wait(WAIT_S)
        later = store.prefetch(tokens).result(WAIT_S)
        assert (later.status, later.num_held, later.num_in_flight, later.num_unfit, later.num_promoted) == (
            PrefetchStatus.DONE, 6, 4, 0, 2)
        gate.release()
        done = running.result(WAIT_S)
        assert (done.num_promoted, done.num_in_flight, done.num_in_memory) == (4, 0, 4)
        assert store.locate(tokens) == [TierKind.CPU] * 6
        assert store.stats().num_prefetch_promoted == 6  # each block read from disk once
        got = store.retrieve(tokens)
        assert torch.equal(_bits(got.kv), _bits(kv))


def test_a_prefetch_reads_the_blocks_a_prefetch_a_clear_voided_is_still_reading(tmp_path: Path) -> None:
    """A prefetch still reading when clear() ran inserts nothing (CLEARED): a prefetch
    planned after the clear must read the prompt's blocks stored since, not skip them as in
    flight. Before, it counted them in flight and left them on disk."""
    tokens, filler = list(range(4 * BLOCK)), list(range(10_000, 10_000 + 8 * BLOCK))
    kv = make_kv(len(tokens), seed=12)
    kw = {"cpu_bytes": 8 * LAYOUT.block_bytes(BLOCK), "io_threads": 2}
    with KVCacheStore(_config(disk_path=str(tmp_path / "d"), **kw)) as writer:
        writer.store(tokens, kv)
    with KVCacheStore(_config(disk_path=str(tmp_path / "d"), **kw)) as store:
        gate = DiskGate(store)  # the first prefetch has read its 4 blocks; its insert waits
        stale = store.prefetch(tokens)
        assert gate.entered.wait(WAIT_S)
        store.clear()
        store.store(tokens, kv)  # the same blocks again, in the new generation ...
        store.store(filler, make_kv(len(filler), seed=13))  # ... pushed out of memory to disk
        assert store.locate(tokens) == [TierKind.DISK] * 4
        fresh = store.prefetch(tokens).result(WAIT_S)
        gate.release()
        assert stale.result(WAIT_S).status is PrefetchStatus.CLEARED
        assert (fresh.status, fresh.num_in_flight, fresh.num_promoted, fresh.num_in_memory) == (
            PrefetchStatus.DONE, 0, 4, 4)
        assert store.locate(tokens) == [TierKind.CPU] * 4
        assert torch.equal(_bits(store.retrieve(tokens).kv), _bits(kv))
        assert store._blocks._prefetch_reading == {}  # both ended: no hash kept
