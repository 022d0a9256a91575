"""Hostile input: hypothesis throws malformed shapes, dtypes, devices, tokens and extra keys at
every public call. Only the documented exceptions may come out (`InvalidInputError` and its
subclasses for bad arguments), and afterwards the store is consistent: its invariants hold and
a prompt stored before the onslaught still comes back bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvstore import (
    ConfigError,
    ExtraKeys,
    InvalidInputError,
    KVCacheStore,
    KVLayout,
    StoreConfig,
)

from .budget import BUDGET
from .conftest import Figures
from .kvgen import SMALL_BLOCK as B
from .kvgen import SMALL_LAYOUT as L
from .kvgen import check_kv, make_kv, open_store

SETTINGS = settings(
    max_examples=BUDGET.hypothesis_examples, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
WEIRD_TEXT = st.sampled_from(["", "a", "\ud800", "\x00", "é" * 3, "🙂"])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4), WEIRD_TEXT,
    st.binary(max_size=4),
)
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
NP_DTYPES = [*INT_DTYPES, "float16", "float32", "float64", "bool", "complex64", ">i4", ">u8"]
TORCH_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float32,
                torch.bfloat16, torch.bool, torch.complex64]


@st.composite
def token_inputs(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(["valid", "valid", "sentinel", "sentinel", "ints", "mixed",
                                 "numpy", "torch", "meta", "scalar", "other"]))
    n = draw(st.integers(0, 6 * B + 3))
    if kind == "valid":
        return draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
    if kind == "sentinel":  # shares a prefix with what is cached: hits, partial hits
        cut = draw(st.integers(0, 4 * B + 2))
        return np.concatenate([SENTINEL[:cut], np.arange(n, dtype=np.uint32)])
    if kind == "ints":
        lo = draw(st.sampled_from([0, -5, -(2**70)]))
        hi = draw(st.sampled_from([2**32 - 1, 2**32, 2**64, 2**70]))
        return draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    if kind == "mixed":
        return draw(st.lists(st.one_of(st.integers(0, 100), SCALARS), max_size=n))
    if kind == "numpy":
        dims = draw(st.sampled_from([0, 1, 1, 1, 2]))
        shape = tuple(draw(st.lists(st.integers(0, n), min_size=dims, max_size=dims)))
        return draw(hnp.arrays(draw(st.sampled_from(NP_DTYPES)), shape))
    if kind == "torch":
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        dims = draw(st.sampled_from([0, 1, 1, 2]))
        shape = tuple(draw(st.lists(st.integers(0, n), min_size=dims, max_size=dims)))
        t = torch.randint(0, 1000, shape).to(dtype)
        return t - 500 if dtype.is_signed and draw(st.booleans()) else t
    if kind == "meta":
        return torch.empty(n, dtype=torch.int64, device="meta")
    if kind == "scalar":
        return draw(SCALARS)
    return draw(st.sampled_from([range(n), tuple(range(n)), {1: 2}, iter(range(3)), object(),
                                 [[1, 2], [3]], b"\x01\x02", "1234"]))


@st.composite
def extra_key_inputs(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(["none", "valid", "built", "wrong-type"]))
    if kind == "none":
        return None
    if kind == "valid":
        return ExtraKeys(cache_salt=draw(st.one_of(st.none(), st.text(max_size=8))),
                         lora_id=draw(st.one_of(st.none(), st.integers(0, 2**63))))
    if kind == "wrong-type":
        return draw(st.one_of(SCALARS, st.just({"cache_salt": "a"}), st.just([1, 2])))
    mm = draw(st.lists(st.one_of(st.tuples(st.one_of(st.text(max_size=3), WEIRD_TEXT, SCALARS),
                                           SCALARS, SCALARS), SCALARS), max_size=3))
    return ExtraKeys(cache_salt=draw(st.one_of(SCALARS, WEIRD_TEXT)),  # may raise: fine
                     lora_id=draw(SCALARS), mm_inputs=mm)


@st.composite
def kv_inputs(draw: st.DrawFn, num_tokens: int) -> object:
    kind = draw(st.sampled_from(["right", "dtype", "shape", "ndim", "noncontig", "grad",
                                 "meta", "sparse", "numpy", "scalar"]))
    shape = list(L.block_shape(num_tokens))
    if kind == "right":
        return torch.zeros(shape, dtype=L.dtype)
    if kind == "dtype":
        return torch.zeros(shape, dtype=draw(st.sampled_from(
            [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float64])))
    if kind == "shape":
        i = draw(st.integers(0, 4))
        shape[i] = draw(st.integers(0, 40).filter(lambda v, old=shape[i]: v != old))
        return torch.zeros(shape, dtype=L.dtype)
    if kind == "ndim":
        return torch.zeros(shape[: draw(st.integers(0, 4))], dtype=L.dtype)
    if kind == "noncontig":
        return torch.zeros(shape[::-1], dtype=L.dtype).permute(4, 3, 2, 1, 0)
    if kind == "grad":
        return torch.zeros(shape, dtype=L.dtype, requires_grad=True)
    if kind == "meta":
        return torch.empty(shape, dtype=L.dtype, device="meta")
    if kind == "sparse":
        return torch.zeros(shape, dtype=torch.float32).to(L.dtype).to_sparse()
    if kind == "numpy":
        return np.zeros(shape, dtype=np.float16)
    return draw(SCALARS)


DEVICES = st.sampled_from([None, "cpu", torch.device("cpu"), "cpu:0", "cuda", "cuda:7", "meta",
                           "mps", "bogus", 0, 3, 2.5, "", object()])


def _call(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except InvalidInputError as exc:
        return type(exc).__name__, exc


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = open_store(str(tmp_path), layout=L, block_size=B, cpu_bytes=64 * L.block_bytes(B))
    yield s
    s.close()


SENTINEL = np.arange(4 * B, dtype=np.uint32) + 4_000_000_000


def _sentinel(store: KVCacheStore) -> np.ndarray:
    store.store(SENTINEL, make_kv(SENTINEL, L, B))
    return SENTINEL


def _still_consistent(store: KVCacheStore, sentinel: np.ndarray) -> None:
    store.check_integrity()
    res = store.retrieve(sentinel)
    assert check_kv(sentinel, res.kv, res.num_tokens, L, B) == 4


def test_hostile_calls(store: KVCacheStore, figures: Figures) -> None:
    sentinel = _sentinel(store)
    outcomes: dict[str, int] = {}

    @SETTINGS
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        tokens = data.draw(token_inputs(), label="tokens")
        try:
            extra = data.draw(extra_key_inputs(), label="extra_keys")
        except InvalidInputError:  # building ExtraKeys from garbage is itself a checked call
            extra = None
            key = "ExtraKeys:InvalidInputError"
            outcomes[key] = outcomes.get(key, 0) + 1
        op = data.draw(st.sampled_from(["store", "retrieve", "lookup", "block_hashes"]))
        if op == "store":
            try:
                n = len(tokens)  # type: ignore[arg-type]
            except TypeError:
                n = 3
            n = data.draw(st.sampled_from([n, n, n + 1, max(0, n - 1)]), label="kv tokens")
            kv = data.draw(kv_inputs(n), label="kv")
            outcome, result = _call(store.store, tokens, kv, extra_keys=extra)
            if outcome == "ok":
                assert result % B == 0
        elif op == "retrieve":
            device = data.draw(DEVICES, label="device")
            outcome, result = _call(store.retrieve, tokens, extra_keys=extra, device=device)
            if outcome == "ok":
                assert result.num_tokens % B == 0
                assert (result.kv is None) == (result.num_tokens == 0)
                if result.kv is not None:
                    assert tuple(result.kv.shape) == L.block_shape(result.num_tokens)
                    assert not result.kv.requires_grad
        elif op == "lookup":
            outcome, result = _call(store.lookup, tokens, extra_keys=extra)
            if outcome == "ok":
                assert result % B == 0
        else:
            outcome, result = _call(store.block_hashes, tokens, extra)
        key = f"{op}:{outcome}"
        outcomes[key] = outcomes.get(key, 0) + 1
        _still_consistent(store, sentinel)

    check()
    assert any(k.endswith(":ok") for k in outcomes) and any(not k.endswith(":ok") for k in outcomes)
    figures.set("examples", sum(v for k, v in outcomes.items() if not k.startswith("ExtraKeys")))
    figures.set("outcomes", dict(sorted(outcomes.items())))


def test_hostile_configs(tmp_path: Path, figures: Figures) -> None:
    """Random layouts and settings: a valid store, or ConfigError, nothing else."""
    num = {"ok": 0, "ConfigError": 0}
    small = st.integers(1, 8)
    ints = st.one_of(small, small, small, st.integers(-3, 70), st.integers(2**40, 2**64), SCALARS)

    @SETTINGS
    @given(num_layers=ints, heads=ints, dim=ints, dtype=st.one_of(
        st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "torch.float32", "int4",
                         torch.float64, torch.int32, torch.uint8, torch.float16])),
        block_size=ints, namespace=st.one_of(st.text(min_size=1, max_size=6), WEIRD_TEXT, SCALARS),
        cpu_bytes=st.one_of(st.integers(1 << 18, 1 << 20), st.integers(-1, 1 << 16), SCALARS),
        disk=st.sampled_from([None, "dir", "dir", "file"]),
        hash_algo=st.one_of(st.sampled_from(["xxh3_128", "sha256", "md5"]), SCALARS))
    def check(num_layers: Any, heads: Any, dim: Any, dtype: Any, block_size: Any, namespace: Any,
              cpu_bytes: Any, disk: str | None, hash_algo: Any) -> None:
        disk_path = None if disk is None else str(tmp_path / disk)
        if disk == "file":
            Path(disk_path).write_bytes(b"not a directory")  # type: ignore[arg-type]
        try:
            layout = KVLayout(num_layers, heads, dim, dtype)
            cfg = StoreConfig(layout=layout, block_size=block_size, namespace=namespace,
                              cpu_bytes=cpu_bytes, disk_path=disk_path, disk_bytes=1 << 20,
                              hash_algo=hash_algo)
            with KVCacheStore(cfg) as s:
                s.check_integrity()
            num["ok"] += 1
        except ConfigError:
            num["ConfigError"] += 1

    check()
    assert num["ok"] > 0 and num["ConfigError"] > 0
    figures.set("examples", sum(num.values()))
    figures.set("outcomes", num)


def test_closed_store_raises_store_closed(store: KVCacheStore) -> None:
    from kvstore import StoreClosedError

    tokens = np.arange(2 * B, dtype=np.uint32)
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.store(tokens, make_kv(tokens, L, B)), lambda: store.retrieve(tokens),
                 lambda: store.lookup(tokens), store.stats, store.clear, store.check_integrity):
        with pytest.raises(StoreClosedError):
            call()


def _grad_kv(n: int) -> torch.Tensor:
    return make_kv(np.arange(n, dtype=np.uint32) + 9, L, B).float().requires_grad_().to(L.dtype)


# Inputs that once escaped as undocumented exceptions or broke the store (see docs/reliability.md).
REGRESSIONS: dict[str, tuple[str, dict[str, Any], type[Exception] | None]] = {
    "device-bogus": ("retrieve", {"device": "bogus"}, InvalidInputError),
    "device-cuda-absent": ("retrieve", {"device": "cuda:63"}, InvalidInputError),
    "device-float": ("retrieve", {"device": 2.5}, InvalidInputError),
    "device-meta": ("retrieve", {"device": "meta"}, InvalidInputError),
    "kv-requires-grad": ("store", {"kv": "grad"}, None),
    "kv-meta": ("store", {"kv": "meta"}, InvalidInputError),
    "kv-sparse": ("store", {"kv": "sparse"}, InvalidInputError),
    "tokens-meta": ("lookup", {"tokens": "meta"}, InvalidInputError),
    "salt-surrogate": ("lookup", {"salt": "\ud800"}, InvalidInputError),
    "lora-surrogate": ("lookup", {"lora": "\ud800"}, InvalidInputError),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_hostile_regressions(store: KVCacheStore, case: str) -> None:
    sentinel = _sentinel(store)
    op, args, error = REGRESSIONS[case]
    tokens: Any = np.arange(2 * B, dtype=np.uint32) + 9
    if args.get("tokens") == "meta":
        tokens = torch.empty(2 * B, dtype=torch.int64, device="meta")

    def call() -> Any:
        if op == "retrieve":
            return store.retrieve(sentinel, device=args["device"])  # a hit, not only a miss
        if op == "lookup":
            extra = None
            if "salt" in args or "lora" in args:
                extra = ExtraKeys(cache_salt=args.get("salt"), lora_id=args.get("lora"))
            return store.lookup(tokens, extra_keys=extra)
        kv = {"grad": _grad_kv(2 * B),
              "meta": torch.empty(L.block_shape(2 * B), dtype=L.dtype, device="meta"),
              "sparse": torch.zeros(L.block_shape(2 * B)).to(L.dtype).to_sparse()}[args["kv"]]
        return store.store(tokens, kv)

    if error is None:
        call()
    else:
        with pytest.raises(error):
            call()
    _still_consistent(store, sentinel)
    if case == "kv-requires-grad":  # the stored block is plain data, and retrievable
        res = store.retrieve(tokens)
        assert res.num_tokens == 2 * B and res.kv is not None and not res.kv.requires_grad


def test_disk_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ConfigError, match="disk_path"):
        open_store(str(tmp_path / "f"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data.mdb").write_bytes(b"not an lmdb file" * 512)
    with pytest.raises(ConfigError, match="disk_path"):
        open_store(str(tmp_path / "d"))
