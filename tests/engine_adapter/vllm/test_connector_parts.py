"""The vLLM connector's engine-free parts: settings, paged block copies, transfer planning."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_adapter.vllm.keys import AdapterKeys, RequestKeys, request_keys
from engine_adapter.vllm.paged_blocks import PagedKVBlocks, opaque_layout
from engine_adapter.vllm.shared_store import acquire_store, find_store, release_store
from engine_adapter.vllm.store_config import model_identity
from engine_adapter.vllm.transfer_plan import TransferPlanner
from engine_adapter.vllm.weights_identity import weights_identity
from kvstore import ConfigError, ExtraKeys, KVCacheStore, MultiModalInput, StoreConfig

# -- paged block copies -----------------------------------------------------------------


def _cpu_like_layers(num_layers: int, num_blocks: int) -> list[torch.Tensor]:
    """vLLM CPU-backend shaped layers: [blocks, heads, tokens, K||V], views of one buffer."""
    g = torch.Generator().manual_seed(0)
    buf = torch.randn((num_layers, num_blocks, 2, 32, 64), generator=g)
    return [buf[i] for i in range(num_layers)]


def test_gather_scatter_round_trip_moves_only_named_blocks() -> None:
    src_layers = _cpu_like_layers(2, 8)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    src, dst = PagedKVBlocks(src_layers, 8, 32), PagedKVBlocks(dst_layers, 8, 32)
    assert src.layout == opaque_layout(2, 2 * 32 * 64 * 4, 32)
    staging = src.staging(3)
    src.gather([5, 1, 6], staging)
    dst.scatter(staging, [0, 2, 7])
    for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(d_layer[[0, 2, 7]], s_layer[[5, 1, 6]])
        assert not d_layer[[1, 3, 4, 5, 6]].any()


def test_strided_layers_and_kernel_block_split() -> None:
    # Heads outermost (block not contiguous in memory); 2 kernel blocks per engine block.
    base = torch.arange(2 * 4 * 2 * 16 * 8, dtype=torch.float16).view(2, 4 * 2, 16, 8)
    layer = base.transpose(0, 1)  # [kernel blocks=8, heads=2, 16, 8], strided
    paged = PagedKVBlocks([layer], num_blocks=4, block_size=32)
    assert paged.kernel_per_block == 2
    staging = paged.staging(1)
    paged.gather([3], staging)
    expected = torch.cat([layer[6].reshape(-1), layer[7].reshape(-1)]).view(torch.uint8)
    assert torch.equal(staging[0, 0].reshape(-1), expected)
    other = torch.zeros_like(base).transpose(0, 1)
    PagedKVBlocks([other], 4, 32).scatter(staging, [0])
    assert torch.equal(other[0:2], layer[6:8])


def test_paged_blocks_reject_mismatched_layers() -> None:
    with pytest.raises(ConfigError, match="not a multiple"):
        PagedKVBlocks([torch.zeros(5, 2, 32, 8)], num_blocks=4, block_size=32)
    with pytest.raises(ConfigError, match="differ"):
        PagedKVBlocks([torch.zeros(4, 2, 32, 8), torch.zeros(4, 2, 32, 4)], 4, 32)


# -- transfer planning ------------------------------------------------------------------


class _Store:
    """A real store over whole-token prefixes, addressed like the connector addresses it."""

    def __init__(self, tmp_path: Path) -> None:
        layout = opaque_layout(1, 64, 4)
        self.store = KVCacheStore(StoreConfig(layout=layout, block_size=4, cpu_bytes=1 << 20))
        self.block = torch.zeros(layout.block_shape(4), dtype=torch.uint8)

    def put(self, tokens: list[int]) -> None:
        self.store.blocks.save(self.store.keys(tokens), [self.block] * (len(tokens) // 4))


def test_planner_loads_the_hit_beyond_local_and_saves_new_full_blocks(tmp_path: Path) -> None:
    s = _Store(tmp_path)
    tokens = list(range(10, 30))  # 5 blocks of 4
    s.put(tokens[:12])  # the store holds blocks 0-2
    planner = TransferPlanner(4, lambda t, k: s.store.lookup(t, extra_keys=k))
    assert planner.num_new_matched_tokens("r", tokens, num_computed=4) == 8
    planner.on_alloc("r", tokens, num_external_tokens=8)
    ids = [40, 41, 42, 43, 44]
    # Step 1: vLLM reports 12 computed (4 local + 8 loaded) and schedules 7 more.
    plan = planner.build([("r", 12, 7)], lambda _: [ids])
    assert [(t.first_block, t.block_ids) for t in plan.loads] == [(1, (41, 42))]
    assert np.array_equal(plan.loads[0].token_ids, np.arange(10, 22, dtype=np.uint32))
    assert [(t.first_block, t.block_ids) for t in plan.saves] == [(3, (43,))]  # 19 // 4 = 4 blocks
    # Step 2: one more token completes block 4; nothing is saved twice.
    plan = planner.build([("r", 19, 1)], lambda _: [ids])
    assert plan.loads == [] and [(t.first_block, t.block_ids) for t in plan.saves] == [(4, (44,))]
    assert planner.build([("r", 20, 1)], lambda _: [ids]).saves == []
    planner.forget("r")
    assert not planner.is_tracked("r")


def test_planner_leaves_one_token_to_compute(tmp_path: Path) -> None:
    s = _Store(tmp_path)
    tokens = list(range(10, 26))  # exactly 4 blocks, all stored
    s.put(tokens)
    planner = TransferPlanner(4, lambda t, k: s.store.lookup(t, extra_keys=k))
    assert planner.num_new_matched_tokens("r", tokens, 0) == 12  # not 16: the last block stays


def test_planner_rejects_unaligned_loads(tmp_path: Path) -> None:
    s = _Store(tmp_path)
    planner = TransferPlanner(4, lambda t, k: s.store.lookup(t, extra_keys=k))
    planner.num_new_matched_tokens("r", list(range(20)), 0)
    with pytest.raises(RuntimeError, match="a bug"):
        planner.on_alloc("r", list(range(20)), num_external_tokens=3)


# -- the per-process store registry -----------------------------------------------------


def test_shared_store_is_reference_counted(tmp_path: Path) -> None:
    config = StoreConfig(layout=opaque_layout(1, 64, 4), block_size=4, cpu_bytes=1 << 20)
    a = acquire_store(config)
    assert acquire_store(config) is a and find_store(config) is a
    release_store(config)
    assert find_store(config) is a
    release_store(config)
    assert find_store(config) is None
    with pytest.raises(RuntimeError, match="closed"):
        a.lookup([1, 2, 3, 4])


# -- isolation keys: salt, LoRA and multimodal inputs change the key ---------


def _request(**fields: object) -> SimpleNamespace:
    """A request as the connector sees it: the attributes vLLM's `Request` carries."""
    base: dict[str, object] = {"prompt_embeds": None, "cache_salt": None, "lora_request": None,
                               "mm_features": [], "all_token_ids": list(range(32))}
    base.update(fields)
    return SimpleNamespace(**base)


def _adapter(path: Path, weights: bytes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def test_request_keys_follow_vllms_extra_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert request_keys(_request(), 4) == RequestKeys(None)
    salted = request_keys(_request(cache_salt="tenant-A"), 4)
    assert salted.cacheable and salted.extra_keys == ExtraKeys(cache_salt="tenant-A")
    lora = SimpleNamespace(lora_name="ad", lora_path=_adapter(tmp_path / "a", b"A" * 64), lora_int_id=3)
    keys = request_keys(_request(lora_request=lora), 4).extra_keys
    assert keys is not None and keys.lora_id is not None
    other = SimpleNamespace(lora_name="ad", lora_path=_adapter(tmp_path / "b", b"B" * 64), lora_int_id=3)
    assert request_keys(_request(lora_request=other), 4).extra_keys != keys  # same name and id, other bytes
    image = SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=4, length=8))
    mm = request_keys(_request(mm_features=[image]), 4).extra_keys
    assert mm is not None and mm.mm_inputs == (MultiModalInput("img-1", 4, 8),)


def test_a_lora_adapter_is_keyed_by_its_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter retrained into the same directory (same name, path and int id, the old
    mtime put back) is another adapter: kvstrata's tiers outlive the engine that loaded the
    old one. The same bytes under another name, path and id (another host) share keys; an
    adapter whose files cannot be read, or that vLLM would download (a hub id), is not keyed
    (a miss, never a guess). Only the files vLLM reads count (a trainer's others do not)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _adapter(tmp_path / "adapter", b"v1" * 512)
    lora = SimpleNamespace(lora_name="mine", lora_path=path, lora_int_id=1)
    first = request_keys(_request(lora_request=lora), 4).extra_keys
    (tmp_path / "adapter" / "checkpoint-100").mkdir()
    (tmp_path / "adapter" / "checkpoint-100" / "optimizer.pt").write_bytes(b"o" * 64)  # not read by vLLM
    assert request_keys(_request(lora_request=lora), 4).extra_keys == first
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    st = weights.stat()
    weights.write_bytes(b"v2" * 512)  # retrained in place: same size, old mtime
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = request_keys(_request(lora_request=lora), 4).extra_keys  # (a fresh engine: nothing pinned)
    assert first is not None and second is not None and second != first
    copy = SimpleNamespace(lora_name="theirs", lora_path=str(shutil.copytree(path, tmp_path / "elsewhere")),
                           lora_int_id=7)
    assert request_keys(_request(lora_request=copy), 4).extra_keys == second
    flag = SimpleNamespace(lora_name="mine", lora_path=path, lora_int_id=1, is_3d_lora_weight=True)
    assert request_keys(_request(lora_request=flag), 4).extra_keys != second  # its weights read otherwise
    monkeypatch.chdir(tmp_path)
    assert request_keys(_request(lora_request=SimpleNamespace(lora_name="rel", lora_path="elsewhere",
                                                              lora_int_id=8)), 4).extra_keys == second
    for missing in (str(tmp_path / "no-such-adapter"), str(tmp_path / "cache"), "some-org/some-adapter"):
        gone = SimpleNamespace(lora_name="gone", lora_path=missing, lora_int_id=2)
        refused = request_keys(_request(lora_request=gone), 4)
        assert not refused.cacheable and "cannot be read" in str(refused.refusal)


def test_an_adapter_rewritten_under_a_running_engine_is_refused_until_reloaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keeps the adapter it loaded for an int id (reloading it only with `load_inplace`,
    or after evicting it): once the files change under a running engine, the engine may
    compute with either version, so that id is refused (it was keyed by the new content
    while computing with the old). A `load_inplace` request pins the new content."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _adapter(tmp_path / "adapter", b"v1" * 512)
    adapters = AdapterKeys()
    lora = SimpleNamespace(lora_name="mine", lora_path=path, lora_int_id=1)
    first = request_keys(_request(lora_request=lora), 4, adapters=adapters).extra_keys
    assert first is not None
    _adapter(tmp_path / "adapter", b"v2" * 512)  # retrained in place while the engine runs
    refused = request_keys(_request(lora_request=lora), 4, adapters=adapters)
    assert not refused.cacheable and "load_inplace" in str(refused.refusal)
    _adapter(tmp_path / "adapter", b"v1" * 512)  # back: the engine may have reloaded v2 meanwhile
    assert not request_keys(_request(lora_request=lora), 4, adapters=adapters).cacheable
    _adapter(tmp_path / "adapter", b"v2" * 512)
    reload = SimpleNamespace(lora_name="mine", lora_path=path, lora_int_id=1, load_inplace=True)
    pinned = request_keys(_request(lora_request=reload), 4, adapters=adapters).extra_keys
    assert pinned is not None and pinned != first
    assert request_keys(_request(lora_request=lora), 4, adapters=adapters).extra_keys == pinned


def _vllm_config(model: str, load_format: str, instance_id: str) -> SimpleNamespace:
    """The parts of a `VllmConfig` `model_identity` reads."""
    hf_config = SimpleNamespace(to_dict=lambda: {"hidden_size": 8, "_name_or_path": model})
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, hf_config=hf_config, dtype="bfloat16",
                                     quantization=None),
        cache_config=SimpleNamespace(cache_dtype="auto", calculate_kv_scales=False),
        load_config=SimpleNamespace(load_format=load_format), instance_id=instance_id)


def test_weights_a_load_format_does_not_read_are_keyed_by_the_engine_instance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_format="dummy"` (random weights, for benchmarks) shared the checkpoint's namespace:
    a real engine on the same disk then served the random model's KV. Now a format that does
    not read the checkpoint's files keys by vLLM's instance id (its scheduler and workers
    share it; nothing else does), and one that reads them keys by content and format."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = _adapter(tmp_path / "ckpt", b"W" * 256)  # (a weight file and a config)
    real = model_identity(_vllm_config(ckpt, "auto", "i1"))  # type: ignore[arg-type]
    assert real == model_identity(_vllm_config(ckpt, "auto", "i2"))  # type: ignore[arg-type]  # any instance
    assert real != model_identity(_vllm_config(ckpt, "pt", "i1"))  # type: ignore[arg-type]  # other files
    dummy = model_identity(_vllm_config(ckpt, "dummy", "i1"))  # type: ignore[arg-type]
    assert dummy != real and dummy == model_identity(_vllm_config(ckpt, "DUMMY", "i1"))  # type: ignore[arg-type]
    assert dummy != model_identity(_vllm_config(ckpt, "dummy", "i2"))  # type: ignore[arg-type]  # another engine
    assert model_identity(_vllm_config("org/not-cached", "dummy", "i1"))  # type: ignore[arg-type]  # no files needed
    assert model_identity(_vllm_config(ckpt, "npcache", "i1"))["weights"][1] == "instance"  # type: ignore[arg-type,index]
    with pytest.raises(ConfigError, match="tensorizer"):
        model_identity(_vllm_config(ckpt, "tensorizer", ""))  # type: ignore[arg-type]


def test_request_keys_refuse_what_they_cannot_key() -> None:
    assert not request_keys(_request(prompt_embeds=torch.zeros(32, 8)), 4).cacheable
    nameless = SimpleNamespace(identifier=None, mm_position=SimpleNamespace(offset=0, length=4))
    assert not request_keys(_request(mm_features=[nameless]), 4).cacheable

    def vllm_keys(request: object, start: int, end: int, mm_index: int) -> tuple[tuple[object, ...] | None, int]:
        return ((("cache_salt", "s"),) if start == 0 else (("new_feature", 1),)), mm_index

    refused = request_keys(_request(cache_salt="s"), 4, vllm_keys)
    assert not refused.cacheable and "new_feature" in str(refused.refusal)


def test_planner_keys_lookups_and_transfers_by_extra_keys(tmp_path: Path) -> None:
    s = _Store(tmp_path)
    tokens = list(range(10, 30))
    a, b = ExtraKeys(cache_salt="tenant-A"), ExtraKeys(cache_salt="tenant-B")
    s.store.blocks.save(s.store.keys(tokens[:12], extra_keys=a), [s.block] * 3)
    planner = TransferPlanner(4, lambda t, k: s.store.lookup(t, extra_keys=k))
    assert planner.num_new_matched_tokens("b", tokens, 0, b) == 0  # another tenant: a miss
    assert planner.num_new_matched_tokens("a", tokens, 0, a) == 12
    planner.on_alloc("a", tokens, 12)
    plan = planner.build([("a", 12, 8)], lambda _: [[1, 2, 3, 4, 5]])
    assert plan.loads[0].extra_keys == a and plan.saves[0].extra_keys == a
    assert planner.num_new_matched_tokens("x", tokens, 0, None, cacheable=False) == 0
    planner.on_alloc("x", tokens, 0)
    assert planner.build([("x", 0, 20)], lambda _: [[1, 2, 3, 4, 5]]).saves == []  # never saved


# -- weights identity: derived from the weights' content, not their path -------------------


def test_weights_identity_follows_content_not_paths_or_mtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"hidden_size": 8}')
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"A" * 4096)
    first = weights_identity(str(ckpt), None)
    copy = tmp_path / "copied-on-another-host"
    shutil.copytree(ckpt, copy)  # new path, new mtimes
    assert weights_identity(str(copy), None) == first
    st = weights.stat()
    weights.write_bytes(b"B" * 4096)  # same size, and the old mtime put back
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(ckpt), None) != first
    (copy / "config.json").write_text('{"hidden_size": 9}')  # configs count too
    assert weights_identity(str(copy), None) != first
    with pytest.raises(ConfigError, match="pin"):
        weights_identity("some-org/some-model-not-in-any-cache", "main")
    assert weights_identity("some-org/m", "0123456789abcdef0123456789abcdef01234567")[2] == (
        "0123456789abcdef0123456789abcdef01234567")


def test_background_loads_fill_blocks_and_delayed_frees_wait_for_them(tmp_path: Path) -> None:
    """The worker's side of asynchronous loads, over a real store and real paged tensors: a
    background load fills exactly the named vLLM blocks and is reported as received; a request
    finished while its load runs is reported for freeing only once that load has ended."""
    import threading

    from engine_adapter.vllm.stats import ConnectorStats
    from engine_adapter.vllm.transfer_plan import BlockTransfer, GroupBlocks, StepPlan
    from engine_adapter.vllm.worker_side import ConnectorWorker

    layout = opaque_layout(1, 64, 4)
    config = StoreConfig(layout=layout, block_size=4, cpu_bytes=1 << 20)
    store = KVCacheStore(config)
    tokens = np.arange(10, 26, dtype=np.uint32)  # 4 blocks
    blocks = [torch.full(layout.block_shape(4), i + 1, dtype=torch.uint8) for i in range(4)]
    store.blocks.save(store.keys(tokens), blocks)
    layer = torch.zeros(8, 64, dtype=torch.uint8)  # 8 engine blocks of 64 bytes, one layer
    worker = ConnectorWorker(store, config, ["l0"], 8, ConnectorStats("worker", None))
    worker.register_kv_caches({"l0": layer})
    gate = threading.Event()
    engine_api = store.blocks
    original = engine_api.load

    def slow_load(*args: object, **kwargs: object) -> object:
        gate.wait(10)  # the load is "on its way" until the test opens the gate
        return original(*args, **kwargs)  # type: ignore[arg-type]

    engine_api.load = slow_load  # type: ignore[method-assign,assignment]
    load = BlockTransfer("r", tokens, (GroupBlocks(0, (5, 6, 7, 2)),))
    worker.load(StepPlan(async_loads=[load]))
    worker.load(StepPlan(delayed_frees=["r"]))  # vLLM aborted it meanwhile
    assert worker.get_finished({"r"}) == (None, None)  # still loading: nothing to report
    gate.set()
    worker.wait_for_loads(10)  # the load job has ended
    sending, recving = worker.get_finished(set())
    assert recving == {"r"} and sending == {"r"}  # named finished earlier, load now over
    for engine_block, value in zip((5, 6, 7, 2), (1, 2, 3, 4)):
        assert (layer[engine_block] == value).all()
    assert (layer[[0, 1, 3, 4]] == 0).all()  # nothing else was written
    assert worker.get_finished(set()) == (None, None)  # each reported once
    assert worker.take_load_errors() == set()
    worker.flush()
    store.close()


def test_connector_lookups_follow_the_load_policy_and_the_worker_reports_prefill(tmp_path: Path) -> None:
    """The scheduler keeps only the leading hit blocks worth loading; the worker times each
    step's forward pass against its prefill tokens for the policy."""
    import time

    from engine_adapter.vllm.scheduler_side import ConnectorScheduler
    from engine_adapter.vllm.stats import ConnectorStats
    from engine_adapter.vllm.transfer_plan import StepPlan
    from engine_adapter.vllm.worker_side import ConnectorWorker
    from tiers.keys import TierKind

    layout = opaque_layout(1, 64, 4)
    config = StoreConfig(layout=layout, block_size=4, cpu_bytes=4 * layout.block_bytes(4),
                         disk_path=str(tmp_path / "d"), disk_bytes=1 << 20, disk_sync=False)
    store = KVCacheStore(config)
    tokens = list(range(10, 42))  # 8 blocks into 4 CPU slots: the prefix stays, the tail goes to disk
    store.blocks.save(store.keys(tokens), [torch.zeros(layout.block_shape(4), dtype=torch.uint8)] * 8)
    assert store.locate(tokens) == [TierKind.CPU] * 4 + [TierKind.DISK] * 4
    scheduler = ConnectorScheduler(store, 4, ConnectorStats("scheduler", None))
    assert scheduler.hit_tokens(tokens, None) == 32  # no prefill rate yet: load all
    worker = ConnectorWorker(store, config, ["l0"], 8, ConnectorStats("worker", None))
    worker.register_kv_caches({"l0": torch.zeros(8, 64, dtype=torch.uint8)})
    worker.step_begins()  # vLLM bound the step's metadata
    worker.load(StepPlan())
    time.sleep(0.01)  # the forward pass
    worker.save(StepPlan(num_prefill_tokens=4000))  # 4000 tokens in >= 10 ms: measured
    rate = store.load_policy.prefill_rate
    assert rate is not None and rate < 4000 / 0.01
    store.load_policy.observe_load(TierKind.CPU, 1 << 30, 1e-3)  # memory: fast
    store.load_policy.observe_load(TierKind.DISK, 64, 10.0)  # a disk slower than recomputing
    assert scheduler.hit_tokens(tokens, None) == 16  # the CPU prefix only
    worker.flush()
    store.close()
