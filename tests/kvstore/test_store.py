"""KVCacheStore: prefix semantics, chaining, isolation, tiers, persistence, bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import (
    ConfigError,
    ExtraKeys,
    InvalidTokensError,
    KVCacheStore,
    KVLayout,
    LayoutMismatchError,
    StoreClosedError,
    StoreConfig,
)
from tests.conftest import BLOCK, LAYOUT, make_kv
from tiers.keys import TierKind

Factory = Callable[..., KVCacheStore]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_prefix_semantics_abcde_abcdf(make_store: Factory) -> None:
    """Store ABCDE, retrieve ABCDF: the blocks of ABCD come back, bit-exact."""
    store = make_store()
    abcde = list(range(5 * BLOCK))
    kv = make_kv(len(abcde))
    assert store.store(abcde, kv) == 5 * BLOCK
    abcdf = abcde[: 4 * BLOCK] + [999] * BLOCK
    res = store.retrieve(abcdf)
    assert res.num_tokens == 4 * BLOCK
    assert torch.equal(bits(res.kv), bits(kv[:, :, : 4 * BLOCK]))
    assert store.lookup(abcdf) == 4 * BLOCK
    store.check_integrity()


def test_partial_trailing_block_is_not_cached(make_store: Factory) -> None:
    store = make_store()
    tokens = list(range(2 * BLOCK + 3))
    assert store.store(tokens, make_kv(len(tokens))) == 2 * BLOCK
    assert store.lookup(tokens) == 2 * BLOCK
    assert store.store(tokens[: BLOCK - 1], make_kv(BLOCK - 1)) == 0


def test_same_block_contents_at_other_position_do_not_match(make_store: Factory) -> None:
    store = make_store()
    a = [7] * BLOCK + [8] * BLOCK
    store.store(a, make_kv(len(a)))
    assert store.lookup([8] * BLOCK) == 0
    assert store.lookup([7] * BLOCK) == BLOCK
    assert store.retrieve([8] * BLOCK + [9] * BLOCK).kv is None


def test_miss_returns_empty_result(make_store: Factory) -> None:
    store = make_store()
    res = store.retrieve(list(range(3 * BLOCK)))
    assert res.num_tokens == 0 and res.kv is None and res.blocks_per_tier == {}
    assert store.retrieve([]).num_tokens == 0


def test_extra_keys_isolate(make_store: Factory) -> None:
    store = make_store()
    tokens = list(range(3 * BLOCK))
    kv_a, kv_b = make_kv(len(tokens), 1), make_kv(len(tokens), 2)
    a, b = ExtraKeys(cache_salt="tenant-a"), ExtraKeys(cache_salt="tenant-b")
    store.store(tokens, kv_a, extra_keys=a)
    assert store.lookup(tokens) == 0
    assert store.lookup(tokens, extra_keys=b) == 0
    store.store(tokens, kv_b, extra_keys=b)
    assert torch.equal(bits(store.retrieve(tokens, extra_keys=a).kv), bits(kv_a))
    assert torch.equal(bits(store.retrieve(tokens, extra_keys=b).kv), bits(kv_b))
    assert store.lookup(tokens, extra_keys=ExtraKeys(lora_id=1)) == 0


def test_namespaces_share_no_entries(tmp_path: Path) -> None:
    def cfg(ns: str, layout: KVLayout = LAYOUT) -> StoreConfig:
        return StoreConfig(layout, block_size=BLOCK, namespace=ns, cpu_bytes=0,
                           disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, disk_sync=False)

    tokens = list(range(2 * BLOCK))
    with KVCacheStore(cfg("model-a")) as a:
        a.store(tokens, make_kv(len(tokens)))
    with KVCacheStore(cfg("model-b")) as b:
        assert b.lookup(tokens) == 0
    other = KVLayout(2, 2, 8, torch.bfloat16)  # same namespace, other dtype
    with KVCacheStore(cfg("model-a", other)) as c:
        assert c.lookup(tokens) == 0
    with KVCacheStore(cfg("model-a")) as a2:
        assert a2.lookup(tokens) == 2 * BLOCK


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_round_trip_from_cpu_tier(make_store: Factory, algo: str) -> None:
    store = make_store(disk=False, hash_algo=algo)
    tokens = list(range(8 * BLOCK))
    kv = make_kv(len(tokens))
    store.store(tokens, kv)
    res = store.retrieve(tokens)
    assert res.blocks_per_tier == {TierKind.CPU: 8}
    assert torch.equal(bits(res.kv), bits(kv))


def test_round_trip_through_demotion_to_disk(make_store: Factory) -> None:
    """A tiny CPU tier forces demotion; every block comes back bit-exact from some tier."""
    store = make_store(cpu_blocks=3)
    docs = [[d * 1000 + i for i in range(6 * BLOCK)] for d in range(4)]
    kvs = [make_kv(len(t), seed=d) for d, t in enumerate(docs)]
    for t, kv in zip(docs, kvs):
        assert store.store(t, kv) == len(t)
        store.check_integrity()
    for t, kv in zip(docs, kvs):
        res = store.retrieve(t)
        assert res.num_tokens == len(t)
        assert torch.equal(bits(res.kv), bits(kv))
        assert sum(res.blocks_per_tier.values()) == 6
        store.check_integrity()
    s = store.stats()
    cpu, disk = s.tiers
    assert cpu.num_evictions > 0 and disk.num_hits > 0
    assert cpu.num_blocks == 3


def test_disk_hit_is_promoted(make_store: Factory) -> None:
    store = make_store(cpu_blocks=2)
    t1, t2 = list(range(2 * BLOCK)), list(range(100, 100 + 2 * BLOCK))
    store.store(t1, make_kv(len(t1), 1))
    store.store(t2, make_kv(len(t2), 2))  # pushes t1 down to disk
    assert store.retrieve(t1).blocks_per_tier == {TierKind.DISK: 2}
    assert store.retrieve(t1).blocks_per_tier == {TierKind.CPU: 2}


def test_disk_only_store(make_store: Factory) -> None:
    store = make_store(cpu_blocks=0)
    tokens = list(range(4 * BLOCK))
    kv = make_kv(len(tokens))
    assert store.store(tokens, kv) == len(tokens)
    res = store.retrieve(tokens)
    assert res.blocks_per_tier == {TierKind.DISK: 4}
    assert torch.equal(bits(res.kv), bits(kv))


@pytest.mark.parametrize("write_through", [False, True])
def test_restart_persistence(tmp_path: Path, write_through: bool) -> None:
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=4 * LAYOUT.block_bytes(BLOCK),
                      disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, write_through=write_through)
    tokens = list(range(10 * BLOCK))
    kv = make_kv(len(tokens), seed=5)
    with KVCacheStore(cfg) as s:
        s.store(tokens, kv)
    with KVCacheStore(cfg) as s:
        res = s.retrieve(tokens)
        assert res.num_tokens == len(tokens)
        assert res.blocks_per_tier == {TierKind.DISK: 10}
        assert torch.equal(bits(res.kv), bits(kv))
        s.check_integrity()


def test_write_through_survives_without_close(tmp_path: Path) -> None:
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * LAYOUT.block_bytes(BLOCK),
                      disk_path=str(tmp_path / "d"), disk_bytes=16 << 20, write_through=True,
                      persist_on_close=False)
    tokens = list(range(3 * BLOCK))
    a = KVCacheStore(cfg)
    a.store(tokens, make_kv(len(tokens)))
    assert a.tiers[1].match_prefix(a.block_hashes(tokens)) == 3  # on disk before any close
    a.close()


def test_retrieve_to_other_dtype_layouts(tmp_path: Path) -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8):
        layout = KVLayout(1, 1, 16, dtype)
        cfg = StoreConfig(layout, block_size=BLOCK, cpu_bytes=layout.block_bytes(BLOCK),
                          disk_path=str(tmp_path / str(dtype)), disk_bytes=1 << 20)
        with KVCacheStore(cfg) as s:
            tokens = list(range(3 * BLOCK))
            kv = make_kv(len(tokens), layout=layout)
            s.store(tokens, kv)
            res = s.retrieve(tokens)
            assert res.kv.dtype == dtype
            assert torch.equal(res.kv.view(torch.uint8), kv.view(torch.uint8)), dtype


def test_store_accepts_any_token_container(make_store: Factory) -> None:
    store = make_store()
    tokens = list(range(2 * BLOCK))
    store.store(np.array(tokens, dtype=np.int64), make_kv(len(tokens)))
    assert store.lookup(torch.tensor(tokens, dtype=torch.int32)) == 2 * BLOCK
    assert store.lookup(tuple(tokens)) == 2 * BLOCK


def test_stats_and_clear(make_store: Factory) -> None:
    store = make_store(cpu_blocks=2)
    tokens = list(range(4 * BLOCK))
    store.store(tokens, make_kv(len(tokens)))
    store.retrieve(tokens)
    store.lookup(tokens)
    s = store.stats()
    assert (s.num_store_calls, s.num_retrieve_calls, s.num_lookup_calls) == (1, 1, 1)
    assert s.num_tokens_hit == len(tokens) and s.hit_ratio == 1.0
    store.clear()
    assert store.lookup(tokens) == 0
    store.check_integrity()


# -- bad input: a precise error, nothing stored ------------------------------------------
BAD_KV = [
    (lambda n: make_kv(n).float(), "dtype"),
    (lambda n: make_kv(n)[0], "shape"),
    (lambda n: make_kv(n + 1), "holds"),
    (lambda n: make_kv(n)[:, :1], "shape"),
    (lambda n: torch.zeros(2, 2, n, 3, 8, dtype=torch.float16), "num_kv_heads=2"),
    (lambda n: make_kv(n).numpy(), "torch.Tensor"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_KV)
def test_bad_kv_raises_and_stores_nothing(make_store: Factory, bad: Callable[[int], object], message: str) -> None:
    store = make_store()
    tokens = list(range(2 * BLOCK))
    with pytest.raises(LayoutMismatchError, match=message):
        store.store(tokens, bad(len(tokens)))
    assert store.lookup(tokens) == 0
    assert store.stats().tiers[0].num_blocks == 0


@pytest.mark.parametrize("tokens", [[1.0] * 8, [-1] * 8, [2**32] * 8, "abcdefgh", [[1] * 8]])
def test_bad_tokens_raise_and_store_nothing(make_store: Factory, tokens: object) -> None:
    store = make_store()
    with pytest.raises(InvalidTokensError):
        store.store(tokens, make_kv(8))
    with pytest.raises(InvalidTokensError):
        store.retrieve(tokens)
    with pytest.raises(InvalidTokensError):
        store.lookup(tokens)
    assert store.stats().tiers[0].num_blocks == 0


def test_bad_config_raises() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        StoreConfig(LAYOUT, block_size=0)
    with pytest.raises(ConfigError, match="no tier"):
        StoreConfig(LAYOUT, cpu_bytes=0)
    with pytest.raises(ConfigError, match="holds no block"):
        StoreConfig(LAYOUT, cpu_bytes=10)
    with pytest.raises(ConfigError, match="hash_algo"):
        StoreConfig(LAYOUT, hash_algo="crc32")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_layers"):
        KVLayout(0, 1, 1)
    with pytest.raises(ConfigError, match="unsupported KV dtype"):
        KVLayout(1, 1, 1, torch.int64)
    with pytest.raises(ConfigError, match="StoreConfig"):
        KVCacheStore(LAYOUT)  # type: ignore[arg-type]
    assert KVLayout(1, 1, 1, "bfloat16").dtype is torch.bfloat16


def test_closed_store_raises(make_store: Factory) -> None:
    store = make_store()
    store.close()
    store.close()
    for call in (lambda: store.lookup([1] * 8), lambda: store.retrieve([1] * 8),
                 lambda: store.store([1] * 8, make_kv(8)), store.stats):
        with pytest.raises(StoreClosedError):
            call()


def test_fastest_tier_serves_each_block(make_store: Factory) -> None:
    """Blocks held by both tiers (inclusive caching) come from the CPU tier."""
    store = make_store(cpu_blocks=4)
    tokens = list(range(8 * BLOCK))
    kv = make_kv(len(tokens))
    store.store(tokens, kv)  # prefix (4 blocks) stays in CPU, the tail overflows to disk
    first = store.retrieve(tokens)
    assert first.blocks_per_tier == {TierKind.CPU: 4, TierKind.DISK: 4}
    store.close()  # persists the CPU blocks to disk as well
    store2 = make_store(cpu_blocks=4)
    r = store2.retrieve(tokens)  # all from disk; the prefix is promoted
    assert r.blocks_per_tier == {TierKind.DISK: 8}
    r = store2.retrieve(tokens)  # blocks 0-3 now in both tiers: CPU serves them
    assert r.blocks_per_tier == {TierKind.CPU: 4, TierKind.DISK: 4}
    assert torch.equal(bits(r.kv), bits(kv))


def test_promotion_never_evicts_the_requests_own_blocks(make_store: Factory) -> None:
    store = make_store(cpu_blocks=4)
    tokens = list(range(12 * BLOCK))
    store.store(tokens, make_kv(len(tokens)))
    for _ in range(3):
        assert store.retrieve(tokens).blocks_per_tier == {TierKind.CPU: 4, TierKind.DISK: 8}
        store.check_integrity()


def test_retrieve_into_a_given_buffer(make_store: Factory) -> None:
    store = make_store(cpu_blocks=2)
    tokens = list(range(4 * BLOCK))
    kv = make_kv(len(tokens))
    store.store(tokens, kv)
    out = torch.full(LAYOUT.block_shape(6 * BLOCK), 7.0, dtype=LAYOUT.dtype)
    res = store.retrieve([*tokens, 1, 2, 3], out=out)
    assert res.num_tokens == 4 * BLOCK and res.kv.data_ptr() == out.data_ptr()
    assert torch.equal(bits(out[:, :, : 4 * BLOCK]), bits(kv))
    assert torch.all(out[:, :, 4 * BLOCK :] == 7.0)  # beyond the prefix: untouched
    with pytest.raises(LayoutMismatchError, match="dtype"):
        store.retrieve(tokens, out=out.float())
    with pytest.raises(LayoutMismatchError, match="fewer"):
        store.retrieve(tokens, out=out[:, :, :BLOCK])
