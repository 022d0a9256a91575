"""Regression tests for the boundary bugs of the correctness issue (items 3-5, 7-13).

Each test reproduces one reported failure (it failed before the fix) and checks the fixed
behaviour: a clear error that changes nothing, or a miss, never another block's bytes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from engine_adapter.runner.block_manager import ComputedBlocks, KVCacheManager
from kvstore import (
    ConfigError,
    ExtraKeys,
    InvalidInputError,
    InvalidTokensError,
    KVCacheStore,
    LayoutMismatchError,
    StoreClosedError,
    StoreConfig,
)
from kvstore.hashing import as_token_array
from tiers.cpu.tier import CPUTier
from tiers.disk import env as lmdb_env
from tiers.disk.tier import LMDBTier
from tiers.keys import TierKind

from .kvgen import BLOCK, LAYOUT, check_kv, make_kv, open_store

ROOT = Path(__file__).resolve().parents[2]


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.uint32)


def _disk(store: KVCacheStore) -> LMDBTier:
    tier = store.tiers[-1]
    assert isinstance(tier, LMDBTier)
    return tier


# -- 3. aliased destinations never poison the CPU tier ---------------------------------------
def test_aliased_destinations_are_refused_and_promotion_stays_exact(tmp_path: Path) -> None:
    tokens = _tokens(3 * BLOCK)
    with open_store(str(tmp_path), cpu_bytes=16 * LAYOUT.block_bytes(BLOCK)) as store:
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        store.tiers[0].spill()
        store.tiers[0].clear()  # blocks now only on disk: a retrieve promotes them
        buf = torch.empty(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
        with pytest.raises(InvalidInputError, match="overlap"):
            store.blocks.load(store.keys(tokens), [buf, buf, buf])
        expanded = torch.empty(LAYOUT.block_shape(1), dtype=LAYOUT.dtype).expand(*LAYOUT.block_shape(3 * BLOCK))
        with pytest.raises(InvalidInputError, match="alias"):
            store.retrieve(tokens, out=expanded)
        whole = torch.empty(LAYOUT.block_shape(2 * BLOCK), dtype=LAYOUT.dtype)
        overlapping = [whole[:, :, i : i + BLOCK] for i in (0, BLOCK // 2, BLOCK)]
        with pytest.raises(InvalidInputError, match="overlap"):
            store.blocks.load(store.keys(tokens), overlapping)
        shape = LAYOUT.block_shape(BLOCK)
        size = math.prod(shape)
        flat = torch.empty(4 * size, dtype=LAYOUT.dtype)
        contiguous = [flat[at : at + size].view(shape) for at in (0, size, 2 * size - 1)]
        with pytest.raises(InvalidInputError, match="overlap"):  # contiguous blocks sharing one element
            store.blocks.load(store.keys(tokens), contiguous)
        mixed = [whole.view(-1)[:size].view(shape), whole[:, :, BLOCK:], flat[:size].view(shape)]
        with pytest.raises(InvalidInputError, match="overlap"):  # a contiguous block over a strided one
            store.blocks.load(store.keys(tokens), mixed)
        assert len(store.tiers[0]) == 0  # nothing was promoted by the refused calls
        apart = [flat[at : at + size].view(shape) for at in (0, size, 2 * size)]
        assert store.blocks.load(store.keys(tokens), apart).num_blocks == 3  # adjacent, not overlapping: read
        check_kv(tokens, torch.cat(apart, dim=2), 3 * BLOCK, LAYOUT, BLOCK)
        store.tiers[0].clear()
        res = store.retrieve(tokens)  # promotes the three blocks
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        res = store.retrieve(tokens)  # now served by the CPU tier: its bytes are the right ones
        assert res.blocks_per_tier == {TierKind.CPU: 3}
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        disjoint = [whole[:, :, i * 4 : i * 4 + BLOCK] for i in range(1)] + [torch.empty_like(buf) for _ in range(2)]
        assert store.blocks.load(store.keys(tokens), disjoint).num_blocks == 3


# -- 4. scrub and clear of one model leave the other model's records alone -------------------
def test_scrub_and_clear_touch_only_their_namespace(tmp_path: Path) -> None:
    other = LAYOUT.__class__(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    a_tokens, b_tokens = _tokens(4 * BLOCK, 1), _tokens(4 * BLOCK, 2)
    with open_store(str(tmp_path), namespace="model-a") as a, \
            open_store(str(tmp_path), namespace="model-b", layout=other) as b:
        a.store(a_tokens, make_kv(a_tokens, LAYOUT, BLOCK))
        b.store(b_tokens, make_kv(b_tokens, other, BLOCK))
        result = _disk(b).scrub()
        assert (result.num_ok, result.num_corrupt, result.num_foreign) == (4, 0, 4)
        assert a.lookup(a_tokens) == 4 * BLOCK
        b.clear()
        assert b.lookup(b_tokens) == 0 and a.lookup(a_tokens) == 4 * BLOCK
        check_kv(a_tokens, a.retrieve(a_tokens).kv, 4 * BLOCK, LAYOUT, BLOCK)
        b.store(b_tokens, make_kv(b_tokens, other, BLOCK))
        b.clear(all_namespaces=True)  # the named whole-directory operation
        assert a.lookup(a_tokens) == 0 and b.lookup(b_tokens) == 0
        a.check_integrity()


# -- 5. a record written without token ids is not corrupt ------------------------------------
def test_record_without_token_ids_is_a_miss_not_corrupt(tmp_path: Path) -> None:
    tokens = _tokens(3 * BLOCK)
    with open_store(str(tmp_path), verify_tokens=False) as writer:
        writer.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    with open_store(str(tmp_path), verify_tokens=True) as reader:
        assert reader.retrieve(tokens).num_tokens == 0  # cannot verify: a miss
        stats = _disk(reader).stats()
        assert stats.num_corrupt == 0 and stats.num_blocks == 3  # nothing deleted
        assert _disk(reader).scrub().num_corrupt == 0
    with open_store(str(tmp_path), verify_tokens=False) as again:
        res = again.retrieve(tokens)
        check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert res.num_tokens == 3 * BLOCK


# -- 7. a map the address space cannot take: ConfigError, the open store unharmed -----------
_UNMAPPABLE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv, open_store
    from kvstore import ConfigError
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))
    tokens = np.arange(2 * BLOCK, dtype=np.uint32)
    first = open_store(sys.argv[1], disk_bytes=64 << 20)
    first.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    for attempt in range(3):
        try:
            open_store(sys.argv[1], disk_bytes=64 << 30)  # a 128 GiB map under a 12 GiB limit
        except ConfigError as exc:
            assert "address space" in str(exc), exc
        else:
            raise AssertionError("an unmappable disk_bytes was accepted")
    res = first.retrieve(tokens)
    check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
    assert res.num_tokens == 2 * BLOCK
    second = open_store(sys.argv[1], disk_bytes=32 << 20)  # later opens still work
    assert second.lookup(tokens) == 2 * BLOCK
    print("ok")
    """
)


def test_unmappable_disk_bytes_is_a_config_error_and_harms_no_open_store(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _UNMAPPABLE, str(tmp_path / "d"), str(ROOT)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# -- 8. unusable tensors: a clear error, no slot or pool block leaked ------------------------
def _unusable_blocks() -> list[tuple[str, torch.Tensor]]:
    shape = LAYOUT.block_shape(BLOCK)
    resized = torch.empty(shape, dtype=LAYOUT.dtype)
    resized.untyped_storage().resize_(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sparse = torch.zeros(shape, dtype=LAYOUT.dtype).to_sparse()
    return [
        ("meta", torch.empty(shape, dtype=LAYOUT.dtype, device="meta")),
        ("sparse", sparse),
        ("storage resized to 0", resized),
        ("requires grad", torch.zeros(shape, dtype=torch.float32).to(LAYOUT.dtype).requires_grad_()),
    ]


@pytest.mark.parametrize("with_pool", [False, True])
def test_unusable_tensors_change_nothing(tmp_path: Path, with_pool: bool) -> None:
    tokens = _tokens(2 * BLOCK)
    extra = {"pool_blocks": 4, "pool_device": "cpu"} if with_pool else {}
    with open_store(str(tmp_path), cpu_bytes=4 * LAYOUT.block_bytes(BLOCK), **extra) as store:
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        before = [t.stats() for t in store.tiers]
        for name, bad in _unusable_blocks():
            good = torch.zeros(LAYOUT.block_shape(BLOCK), dtype=LAYOUT.dtype)
            if name != "requires grad":  # a source that requires grad is fine to read
                with pytest.raises(LayoutMismatchError):
                    store.blocks.save(store.keys(_tokens(2 * BLOCK, 9)), [good, bad])
            with pytest.raises((LayoutMismatchError, InvalidInputError)):
                store.blocks.load(store.keys(tokens), [good, bad])
            store.check_integrity()
        assert [t.stats() for t in store.tiers] == before
        if with_pool:
            assert store.pool is not None and len(store.pool.free_queue) == 4
        free = store.tiers[-2]
        assert isinstance(free, CPUTier) and free.num_free_slots == free.capacity_blocks - len(free)


# -- 9. a forked child opens a store of its own --------------------------------------------
def test_forked_child_opens_its_own_store(tmp_path: Path) -> None:
    tokens = _tokens(2 * BLOCK)
    parent = open_store(str(tmp_path))
    parent.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report through the pipe, never return into pytest
        code = 1
        try:
            try:
                parent.lookup(tokens)
                message = "the parent's store worked in the child"
            except StoreClosedError as exc:
                message = "ok" if "fork" in str(exc) else f"unclear error: {exc}"
            if message == "ok":
                with open_store(str(tmp_path)) as child:
                    res = child.retrieve(tokens)
                    check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK)
                    more = _tokens(3 * BLOCK, 5)
                    child.store(more, make_kv(more, LAYOUT, BLOCK))
                    message = "ok" if res.num_tokens == 2 * BLOCK else "child missed"
            code = 0
        except BaseException as exc:  # report anything to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode()[:4000])
        os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    message = os.read(read, 4096).decode()
    os.close(read)
    assert status == 0 and message == "ok", message
    assert parent.lookup(_tokens(3 * BLOCK, 5)) == 3 * BLOCK  # the child's writes, seen here
    parent.close()


# -- 10. another process grows the map; a truncated data file ---------------------------------
_GROW = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, sys.argv[2])
    from kvstore import KVLayout
    from tests.reliability.kvgen import open_store
    big = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 1 MiB blocks of 32
    with open_store(sys.argv[1], layout=big, block_size=32, namespace="grower", disk_bytes=512 << 20) as store:
        for i in range(100):  # 100 MiB: beyond the parent's map
            t = np.arange(i * 32, i * 32 + 32, dtype=np.uint32)
            store.store(t, torch.full(big.block_shape(32), float(i), dtype=big.dtype))
    """
)


def test_map_grown_by_another_process_is_adopted(tmp_path: Path) -> None:
    tokens = _tokens(2 * BLOCK)
    with open_store(str(tmp_path), disk_bytes=1 << 20) as store:  # a 66 MiB map
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        subprocess.run([sys.executable, "-c", _GROW, str(tmp_path), str(ROOT)], check=True, timeout=120)
        assert store.lookup(tokens) == 2 * BLOCK  # raised lmdb.MapResizedError before
        more = _tokens(2 * BLOCK, 3)
        store.store(more, make_kv(more, LAYOUT, BLOCK))
        res = store.retrieve(more)
        check_kv(more, res.kv, res.num_tokens, LAYOUT, BLOCK)
        store.check_integrity()


def test_truncated_data_file_is_a_config_error(tmp_path: Path) -> None:
    with open_store(str(tmp_path)) as store:
        for i in range(20):
            t = _tokens(8 * BLOCK, i)
            store.store(t, make_kv(t, LAYOUT, BLOCK))
    data = tmp_path / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(ConfigError, match="truncated"):
        open_store(str(tmp_path))
    assert not lmdb_env._ENVS


# -- 11. every way an open can fail: ConfigError, nothing leaked ----------------------------
def test_bad_opens_raise_config_error_and_leak_nothing(tmp_path: Path) -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ConfigError, match="RAM"):
        open_store(str(tmp_path / "a"), cpu_bytes=2 * ram)
    assert not lmdb_env._ENVS
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"meta", b"someone else's value")
    env.close()
    with pytest.raises(ConfigError, match="not kvstrata"):
        open_store(str(foreign))
    assert not lmdb_env._ENVS
    for bad in ({"disk_bytes": 2**63}, {"disk_path": str(tmp_path / "nul\x00byte")}):
        with pytest.raises(ConfigError):
            StoreConfig(LAYOUT, block_size=BLOCK, **{"disk_path": str(tmp_path / "b"), **bad})
    assert not lmdb_env._ENVS


# -- 12. the manager: a vanished planned block, a malformed plan, a closed store -------------
def test_manager_vanished_plan_bad_plan_and_closed_store(tmp_path: Path) -> None:
    tokens = _tokens(6 * BLOCK)
    store = open_store(str(tmp_path), pool_blocks=8, pool_device="cpu", cpu_bytes=16 * LAYOUT.block_bytes(BLOCK))
    store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    pool, cpu = store.pool, store.tiers[1]
    assert pool is not None and isinstance(cpu, CPUTier)
    pool.spill()
    pool.clear()
    mgr = KVCacheManager(store)
    mgr.add_request("r", np.concatenate([tokens, [1]]))
    computed = mgr.get_computed_blocks("r")
    assert computed.lower_plan == [TierKind.CPU] * 6
    cpu.discard(store.block_hashes(tokens)[2:3])  # a planned block vanishes before allocation
    mgr.allocate_slots("r", 1, computed)
    assert cpu.num_pinned == 0, "blocks after the vanished one stayed pinned"
    cpu.check_integrity()
    mgr.free("r")
    free_before = len(pool.free_queue)
    mgr.add_request("s", np.concatenate([tokens, [2]]))
    for plan in ([1, 7], ["x"], [True], [1.0], ["cpu"], [TierKind.POOL], [TierKind("nosuch")]):
        with pytest.raises(InvalidInputError, match="computed"):
            mgr.allocate_slots("s", 1, ComputedBlocks(len(plan) * BLOCK, [], plan))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="computed"):
        mgr.allocate_slots("s", 1, ComputedBlocks(BLOCK, [object()], []))  # type: ignore[list-item]
    assert len(pool.free_queue) == free_before and cpu.num_pinned == 0
    store.check_integrity()
    store.close()
    with pytest.raises(StoreClosedError):
        mgr.commit("s", 1)
    with pytest.raises(StoreClosedError):
        mgr.add_request("t", [1, 2, 3])


# -- 13. token containers ------------------------------------------------------------------
def test_token_containers_get_one_clear_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad = {
            "sparse": torch.tensor([1, 2, 3]).to_sparse(),
            "quantized": torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 1.0, 0, torch.quint8),
            "nested": torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])]),
            "masked": np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]),
            "ragged": [[1, 2], [3]],
            "nested list": [[1, 2], [3, 4]],
            "negative object": np.array([1, -1], dtype=object),
        }
    for name, value in bad.items():
        with pytest.raises(InvalidTokensError):
            as_token_array(value)
        assert name
    small = as_token_array(np.array([1, 2, 2**32 - 1], dtype=object))
    assert small.dtype == np.dtype("<u4") and small.tolist() == [1, 2, 2**32 - 1]
    assert ExtraKeys(cache_salt="x").cache_salt == "x"
