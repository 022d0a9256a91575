"""Hostile input through the request-level `KVCacheManager` and the pool's settings.

Hypothesis drives random sequences of manager calls with bad request ids, duplicate adds,
garbage tokens, counts and `computed` hints (stale, another request's, malformed), commits
beyond the allocation and double frees, on a pool small enough that allocations fail. Only
`InvalidInputError` subclasses and `NoFreeBlocksError` may come out; a refused allocation
changes nothing (free-queue order, ref counts, cache map, the request); after every call the
store's invariants hold and every block's ref count equals the number of live requests
holding it; at the end, with every request freed, the whole pool is free and a sentinel
prompt is still exact. Random pool configurations raise only `ConfigError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine_adapter.runner.block_manager import ComputedBlocks, KVCacheManager
from kvstore import ConfigError, ExtraKeys, InvalidInputError, KVCacheStore, StoreConfig
from tests.conftest import POOL_DEVICE
from tiers.disk import env as lmdb_env
from tiers.pool.gpu_pool import NoFreeBlocksError

from .conftest import Figures
from .kvgen import SMALL_BLOCK as B
from .kvgen import SMALL_LAYOUT as L
from .kvgen import check_kv, make_kv, open_store
from .runnerkv import check_blocks, write_blocks
from .test_hostile import SCALARS, SETTINGS, WEIRD_TEXT, token_inputs

SENTINEL = np.arange(4 * B, dtype=np.uint32) + 4_000_000_000
IDS = st.one_of(st.sampled_from(["r4", "", "\ud800", ["r0"], {"r": 1}, b"r0"]), SCALARS)


@st.composite
def prompts(draw: st.DrawFn) -> np.ndarray:
    """A valid prompt of up to 9 blocks: the sentinel's prefix or a few shared roots, and a tail."""
    root = draw(st.sampled_from([SENTINEL, np.arange(6 * B, dtype=np.uint32) + 7,
                                 np.arange(6 * B, dtype=np.uint32) + 900]))
    cut = draw(st.integers(0, len(root)))
    tail = draw(st.lists(st.integers(0, 2**32 - 1), max_size=3 * B + 2))
    return np.concatenate([root[:cut], np.array(tail, dtype=np.uint32)]).astype(np.uint32)
COUNTS = st.one_of(st.integers(0, 8 * B), st.integers(-3, 0), st.integers(2**40, 2**64),
                   st.sampled_from([True, 2.5, "3", None, np.int64(5), np.uint8(2)]))


def snapshot(mgr: KVCacheManager) -> tuple[Any, ...]:
    """Everything a refused allocation must leave as it was."""
    pool = mgr.store.pool
    reqs = {rid: (mgr.token_ids(rid), mgr.block_table(rid), mgr.num_cached_blocks(rid), mgr.num_computed_tokens(rid))
            for rid in mgr.request_ids()}
    return (pool.free_queue.ids(), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            dict(pool.cached), reqs)


def check_refs(mgr: KVCacheManager) -> None:
    """Each block's ref count is the number of live requests whose table holds it."""
    held = [0] * mgr.store.pool.num_blocks
    for rid in mgr.request_ids():
        for block_id in mgr.block_table(rid):
            held[block_id] += 1
    refs = [b.ref_cnt for b in mgr.store.pool.blocks]
    assert refs == held, f"ref counts {refs} != requests holding the block {held}"


def _store(tmp_path: Path) -> KVCacheStore:
    return open_store(str(tmp_path), layout=L, block_size=B, pool_blocks=12, pool_device=POOL_DEVICE,
                      cpu_bytes=16 * L.block_bytes(B), disk_bytes=4 << 20)


def test_hostile_manager_calls(tmp_path: Path, figures: Figures) -> None:
    store = _store(tmp_path)
    mgr = KVCacheManager(store)
    store.store(SENTINEL, make_kv(SENTINEL, L, B))
    outcomes: dict[str, int] = {}
    computed: dict[Any, ComputedBlocks] = {}

    def note(key: str) -> None:
        outcomes[key] = outcomes.get(key, 0) + 1

    @SETTINGS
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        computed.clear()
        try:
            # A seeded stream picks the calls (mostly well-formed ids and counts, so requests
            # live long enough to fill the pool); hypothesis draws the hostile values.
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
            for _ in range(int(rng.integers(4, 24))):
                op = str(rng.choice(["add", "add", "computed", "allocate", "allocate", "allocate",
                                     "commit", "commit", "append", "free", "views"]))
                live = sorted(mgr.request_ids())
                free_ids = [f"r{i}" for i in range(4) if f"r{i}" not in mgr]
                mine = free_ids if op == "add" else live
                if mine and rng.random() < 0.8:
                    rid: Any = str(rng.choice(mine))
                else:
                    rid = f"r{rng.integers(4)}" if rng.random() < 0.5 else data.draw(IDS, label="id")
                try:
                    _one_call(data, rng, mgr, op, rid, computed)
                    note(f"{op}:ok")
                except NoFreeBlocksError:
                    note(f"{op}:NoFreeBlocksError")
                except InvalidInputError as exc:
                    note(f"{op}:{type(exc).__name__}")
                store.check_integrity()
                check_refs(mgr)
        finally:
            for rid in mgr.request_ids():
                mgr.free(rid)
        pool = mgr.store.pool
        assert len(pool.free_queue) == pool.num_blocks and not mgr.request_ids()
        store.check_integrity()
        res = store.retrieve(SENTINEL)
        assert check_kv(SENTINEL, res.kv, res.num_tokens, L, B) == 4

    try:
        check()
    finally:
        store.close()
    assert outcomes.get("allocate:NoFreeBlocksError", 0) > 0, sorted(outcomes.items())
    figures.set("examples", SETTINGS.max_examples)
    figures.set("calls", sum(outcomes.values()))
    figures.set("outcomes", dict(sorted(outcomes.items())))


def _count(data: st.DataObject, rng: np.random.Generator, label: str) -> Any:
    return int(rng.integers(0, 8 * B)) if rng.random() < 0.85 else data.draw(COUNTS, label=label)


def _one_call(data: st.DataObject, rng: np.random.Generator, mgr: KVCacheManager, op: str, rid: Any,
              computed: dict[Any, ComputedBlocks]) -> None:
    if op == "add":
        tokens = data.draw(prompts() if rng.random() < 0.8 else token_inputs(), label="tokens")
        extra = None
        if rng.random() < 0.2:
            extra = data.draw(st.one_of(st.just(ExtraKeys(cache_salt="t")), SCALARS, WEIRD_TEXT),
                              label="extra_keys")
        known = rid in mgr
        try:
            mgr.add_request(rid, tokens, extra)  # type: ignore[arg-type]
        except InvalidInputError:
            if not known:
                assert rid not in mgr, "a refused add left the request registered"
            raise
        assert not known, "a duplicate add was accepted"
    elif op == "computed":
        computed[repr(rid)] = mgr.get_computed_blocks(rid)
    elif op == "allocate":
        which = str(rng.choice(["none", "own", "own", "own", "other", "garbage"]))
        hint: Any = None
        if which == "own":
            hint = computed.get(repr(rid))
        elif which == "other" and computed:
            hint = data.draw(st.sampled_from(list(computed.values())))
        elif which == "garbage":
            hint = data.draw(st.sampled_from([(0, [], []), ComputedBlocks(B, [], []),
                                              ComputedBlocks(-B, [], [1]), ComputedBlocks(0, [3], []),
                                              ComputedBlocks("x", 0, None), "computed"]))
        n = _count(data, rng, "num_new_tokens")
        before = snapshot(mgr)
        try:
            alloc = mgr.allocate_slots(rid, n, hint)
        except NoFreeBlocksError:
            assert snapshot(mgr) == before, "a refused allocation changed the pool or the request"
            raise
        except InvalidInputError:
            assert snapshot(mgr) == before, "a rejected allocation changed the pool or the request"
            raise
        tokens = np.asarray(mgr.token_ids(rid), dtype=np.uint32)
        table = mgr.block_table(rid)
        reused = alloc.num_computed_tokens
        if not before[3][rid][1]:  # the first allocation: a cached prefix, whole blocks, one token left
            assert reused % B == 0 and reused <= max(0, len(tokens) - 1)
        assert reused <= len(tokens)  # later: the progress committed so far
        check_blocks(mgr.store.pool, table, tokens, reused // B, L, B)  # never damaged or foreign KV
    elif op == "commit":
        n = _count(data, rng, "num_computed_tokens")
        tokens = np.asarray(mgr.token_ids(rid), dtype=np.uint32) if rid in mgr else None
        if tokens is not None and isinstance(n, int) and 0 <= n <= len(tokens):  # "compute" first
            table = mgr.block_table(rid)
            done = mgr.num_computed_tokens(rid) // B
            write_blocks(mgr.store.pool, table, tokens, done, min(n // B, len(table)), L, B)
        mgr.commit(rid, n)
    elif op == "append":
        new: Any = rng.integers(0, 2**32, size=int(rng.integers(0, B + 2)), dtype=np.uint32).tolist()
        if rng.random() < 0.2:
            new = data.draw(token_inputs(), label="new tokens")
        mgr.append_tokens(rid, new)  # type: ignore[arg-type]
    elif op == "free":
        mgr.free(rid)
        assert rid not in mgr
    else:
        mgr.block_table(rid)
        mgr.num_computed_tokens(rid)
        mgr.token_ids(rid)


def _fill(store: KVCacheStore, mgr: KVCacheManager, rng: np.random.Generator) -> np.ndarray:
    """Cache a 3-block prompt in the pool (unreferenced), then hold all but one pool block."""
    cached = rng.integers(0, 2**32, size=3 * B, dtype=np.uint32)
    store.store(cached, make_kv(cached, L, B))
    pool = mgr.store.pool
    hog = rng.integers(0, 2**32, size=(pool.num_blocks - 4) * B, dtype=np.uint32)
    mgr.add_request("hog", hog)
    mgr.allocate_slots("hog", len(hog), mgr.get_computed_blocks("hog"))
    return cached


def test_no_free_blocks_changes_nothing(tmp_path: Path) -> None:
    """An allocation one block short, with pool hits at ref 0 among its blocks: refused whole."""
    rng = np.random.default_rng(5)
    store = _store(tmp_path)
    mgr = KVCacheManager(store)
    try:
        cached = _fill(store, mgr, rng)
        prompt = np.concatenate([cached, rng.integers(0, 2**32, size=2 * B + 1, dtype=np.uint32)])
        mgr.add_request("r", prompt)
        comp = mgr.get_computed_blocks("r")
        assert len(comp.pool_blocks) == 3 and all(b.ref_cnt == 0 for b in comp.pool_blocks)
        assert not mgr.can_allocate("r", len(prompt) - comp.num_tokens, comp)
        before = snapshot(mgr)
        with pytest.raises(NoFreeBlocksError):
            mgr.allocate_slots("r", len(prompt) - comp.num_tokens, comp)
        assert snapshot(mgr) == before
        store.check_integrity()
        check_refs(mgr)
        mgr.free("hog")  # now it fits, and reuses the three cached blocks
        alloc = mgr.allocate_slots("r", len(prompt) - comp.num_tokens, comp)
        assert alloc.num_computed_tokens == 3 * B
        check_blocks(mgr.store.pool, mgr.block_table("r"), prompt, 3, L, B)
        store.check_integrity()
    finally:
        store.close()


@pytest.mark.parametrize("case", ["evicted-in-between", "another-requests"])
def test_stale_computed_is_looked_up_again(tmp_path: Path, case: str) -> None:
    """Regression: `allocate_slots` trusted the pool blocks `get_computed_blocks` had found.
    A `store()` between the two (another thread, or the same one) evicted and reused them, and
    the request was handed blocks holding another prefix's KV as its cached prefix."""
    rng = np.random.default_rng(6)
    store = _store(tmp_path)
    mgr = KVCacheManager(store)
    try:
        a = rng.integers(0, 2**32, size=4 * B, dtype=np.uint32)
        store.store(a, make_kv(a, L, B))
        prompt = np.concatenate([a, [7]]).astype(np.uint32)
        mgr.add_request("r", prompt)
        if case == "evicted-in-between":
            comp = mgr.get_computed_blocks("r")
            assert len(comp.pool_blocks) == 4
            other = rng.integers(0, 2**32, size=12 * B, dtype=np.uint32)
            store.store(other, make_kv(other, L, B))  # evicts (demotes) every block of `a`
        else:  # a hint computed for a different prompt
            b = rng.integers(0, 2**32, size=4 * B, dtype=np.uint32)
            store.store(b, make_kv(b, L, B))
            mgr.add_request("b", np.concatenate([b, [7]]).astype(np.uint32))
            comp = mgr.get_computed_blocks("b")
        alloc = mgr.allocate_slots("r", len(prompt) - comp.num_tokens, comp)
        table = mgr.block_table("r")
        check_blocks(mgr.store.pool, table, prompt, alloc.num_computed_tokens // B, L, B)
        assert alloc.num_computed_tokens == 4 * B  # found again (pool, or CPU after demotion)
        assert len(table) == 5
        store.check_integrity()
        check_refs(mgr)
    finally:
        store.close()


DEVICES = st.sampled_from([None, "cpu", "cpu:0", torch.device("cpu"), "cuda", "cuda:7", "meta",
                           "mps", "bogus", "", 0, 5, 2.5, object()])


def test_hostile_pool_configs(tmp_path: Path, figures: Figures) -> None:
    """Random pool sizes, devices and demotion policies: a working store, or ConfigError (and
    no tier left open behind it)."""
    num = {"ok": 0, "ConfigError": 0}
    # Never a size between 16 blocks and "more than the machine has": that would really be zeroed.
    not_ints = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=4), st.binary(max_size=4))
    sizes = st.one_of(st.integers(1, 16), st.integers(-2, 0), st.sampled_from([2**40, 2**62, 2**64]),
                      not_ints)

    @SETTINGS
    @given(data=st.data(), cpu=st.booleans(), disk=st.booleans())
    def check(data: st.DataObject, cpu: bool, disk: bool) -> None:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))

        def pick(sane: list[Any], hostile: st.SearchStrategy[Any], label: str) -> Any:
            return sane[int(rng.integers(len(sane)))] if rng.random() < 0.75 else data.draw(hostile, label=label)

        pool_blocks = pick(list(range(1, 17)), sizes, "pool_blocks")
        device = pick([None, "cpu", "cpu:0", torch.device("cpu")], DEVICES, "pool_device")
        demotion = pick(["on_evict", "write_through"], st.one_of(
            st.sampled_from(["WRITE_THROUGH", "lru", ""]), SCALARS), "pool_demotion")
        try:
            cfg = StoreConfig(L, block_size=B, pool_blocks=pool_blocks, pool_device=device,
                              pool_demotion=demotion, cpu_bytes=8 * L.block_bytes(B) if cpu else 0,
                              disk_path=str(tmp_path / "d") if disk else None, disk_bytes=1 << 20)
            store = KVCacheStore(cfg)
        except ConfigError:
            num["ConfigError"] += 1
            assert not lmdb_env._ENVS, "a refused config left an LMDB environment open"
            return
        with store:
            tokens = np.arange(3 * B, dtype=np.uint32)
            store.store(tokens, make_kv(tokens, L, B))
            res = store.retrieve(tokens)
            check_kv(tokens, res.kv, res.num_tokens, L, B)
            if store.pool is not None:
                mgr = KVCacheManager(store)
                mgr.add_request("r", np.concatenate([tokens, [1]]))
                comp = mgr.get_computed_blocks("r")
                if mgr.can_allocate("r", 1, comp):
                    mgr.allocate_slots("r", 1, comp)
                mgr.free("r")
            store.check_integrity()
        num["ok"] += 1

    check()
    assert num["ok"] > 0 and num["ConfigError"] > 0
    figures.set("examples", sum(num.values()))
    figures.set("outcomes", num)
