"""Isolation: different `cache_salt`s (tenants), LoRA adapters and namespaces never share a
block, whatever their tokens, even on one disk directory. The KV of each tenant is derived
from its own tag, so a block served across tenants would also fail the byte check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore import ExtraKeys
from tests.conftest import POOL_DEVICE

from .conftest import Figures
from .kvgen import SMALL_BLOCK as B
from .kvgen import SMALL_LAYOUT as L
from .kvgen import check_kv, make_kv, open_store
from .test_hostile import SETTINGS

TOKENS = st.lists(st.integers(0, 2**32 - 1), min_size=B, max_size=5 * B).map(
    lambda t: np.array(t, dtype=np.uint32))
SALTS = st.one_of(st.text(max_size=6), st.binary(max_size=6))


def test_salts_never_share_blocks(tmp_path: Path, figures: Figures) -> None:
    store = open_store(str(tmp_path), layout=L, block_size=B, cpu_bytes=16 * L.block_bytes(B),
                       disk_bytes=8 << 20)
    num = {"examples": 0, "cross_lookups": 0, "own_hits": 0}
    try:
        @SETTINGS
        @given(tokens=TOKENS, salts=st.lists(SALTS, min_size=2, max_size=4, unique=True),
               lora=st.one_of(st.none(), st.integers(0, 3)))
        def check(tokens: np.ndarray, salts: list[str | bytes], lora: int | None) -> None:
            # Salt "x" as str and as bytes are different salts; None is the unsalted tenant.
            tenants = [ExtraKeys(cache_salt=s, lora_id=lora) for s in salts]
            tenants.append(ExtraKeys(lora_id=lora))
            tags = [repr(("salt", s, lora)) for s in [*salts, None]]
            store.clear()  # examples repeat tokens: each one starts from an empty store
            first = tenants[0]
            store.store(tokens, make_kv(tokens, L, B, tags[0]), extra_keys=first)
            for other in tenants[1:]:
                if other.cache_salt == first.cache_salt and type(other.cache_salt) is type(
                        first.cache_salt):
                    continue
                assert store.lookup(tokens, extra_keys=other) == 0
                res = store.retrieve(tokens, extra_keys=other)
                assert res.num_tokens == 0 and res.kv is None
                num["cross_lookups"] += 1
            # Every tenant stores its own KV for the same tokens and gets its own back.
            for tenant, tag in zip(tenants, tags, strict=True):
                store.store(tokens, make_kv(tokens, L, B, tag), extra_keys=tenant)
            for tenant, tag in zip(tenants, tags, strict=True):
                res = store.retrieve(tokens, extra_keys=tenant)
                if res.num_tokens:
                    check_kv(tokens, res.kv, res.num_tokens, L, B, tag)
                    num["own_hits"] += 1
            store.check_integrity()
            num["examples"] += 1

        check()
        assert num["own_hits"] > 0 and num["cross_lookups"] > 0
        for key, value in num.items():
            figures.set(key, value)
    finally:
        store.close()


def test_namespaces_never_share_entries(tmp_path: Path, figures: Figures) -> None:
    """Two models on one disk directory (and one process): same tokens, separate entries."""
    a = open_store(str(tmp_path), layout=L, block_size=B, namespace="model-a", cpu_bytes=0)
    b = open_store(str(tmp_path), layout=L, block_size=B, namespace="model-b", cpu_bytes=0)
    try:
        rng = np.random.default_rng(3)
        num = 0
        for _ in range(50):
            tokens = rng.integers(0, 2**32, size=int(rng.integers(1, 6)) * B, dtype=np.uint32)
            a.store(tokens, make_kv(tokens, L, B, "model-a"))
            assert b.lookup(tokens) == 0
            b.store(tokens, make_kv(tokens, L, B, "model-b"))
            for store, tag in ((a, "model-a"), (b, "model-b")):
                res = store.retrieve(tokens)
                assert check_kv(tokens, res.kv, res.num_tokens, L, B, tag) == len(tokens) // B
            assert not set(a.block_hashes(tokens)) & set(b.block_hashes(tokens))
            num += 1
        a.check_integrity()
        figures.set("prompts", num)
    finally:
        a.close()
        b.close()


def test_salts_never_share_pool_blocks_through_the_manager(tmp_path: Path, figures: Figures) -> None:
    """Tenants with the same tokens and different `cache_salt`s, served through one
    `KVCacheManager`: none is ever offered another's pool (or lower-tier) blocks, each reuses
    its own, and a salted `store()` is found by the same salt's requests only."""
    from engine_adapter.runner.block_manager import KVCacheManager

    from .runnerkv import serve

    store = open_store(str(tmp_path), layout=L, block_size=B, pool_blocks=32, pool_device=POOL_DEVICE,
                       cpu_bytes=16 * L.block_bytes(B), disk_bytes=8 << 20)
    mgr = KVCacheManager(store)
    num = {"examples": 0, "cross_misses": 0, "own_reuses": 0}
    try:
        @SETTINGS
        @given(tokens=TOKENS, salts=st.lists(SALTS, min_size=2, max_size=3, unique_by=repr))
        def check(tokens: np.ndarray, salts: list[str | bytes]) -> None:
            store.clear()
            prompt = np.append(tokens, np.uint32(1))  # whole blocks cached, one token to compute
            tenants = [ExtraKeys(cache_salt=s) for s in salts] + [None]
            tags = [repr(("salt", s)) for s in salts] + ["unsalted"]
            # Tenant 0 caches its KV twice over: through the manager and through store().
            serve(mgr, "first", prompt, L, B, tag=tags[0], extra_keys=tenants[0])
            store.store(tokens, make_kv(tokens, L, B, tags[0]), extra_keys=tenants[0])
            theirs = {b.block_id for b in store.pool.cached.values()}  # type: ignore[union-attr]
            for i, (tenant, tag) in enumerate(zip(tenants, tags, strict=True)):
                mgr.add_request("probe", prompt, tenant)
                computed = mgr.get_computed_blocks("probe")
                mgr.free("probe")
                if i == 0:
                    assert computed.num_tokens == len(tokens) // B * B
                    continue
                assert computed.num_tokens == 0 and not computed.pool_blocks, "saw another tenant's blocks"
                num["cross_misses"] += 1
                got = serve(mgr, f"t{i}", prompt, L, B, tag=tag, extra_keys=tenant)  # checks bytes
                assert got is not None and got[0] == 0
                mgr.add_request("own", prompt, tenant)
                alloc = mgr.allocate_slots("own", 1, mgr.get_computed_blocks("own"))
                assert not set(mgr.block_table("own")[: alloc.num_computed_tokens // B]) & theirs
                mgr.free("own")
                got = serve(mgr, f"t{i}-again", prompt, L, B, tag=tag, extra_keys=tenant)
                assert got is not None and got[0] == len(tokens) // B * B
                num["own_reuses"] += 1
            store.check_integrity()
            num["examples"] += 1

        check()
        assert num["cross_misses"] > 0 and num["own_reuses"] > 0
        for key, value in num.items():
            figures.set(key, value)
    finally:
        store.close()
