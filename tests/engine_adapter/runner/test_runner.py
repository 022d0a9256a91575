"""Fidelity: generation with the store equals generation without it, from every tier.

A tiny random-weight Llama (float32). For random prompts sharing prefixes, the generated
tokens with the reused prefix served from the pool, the CPU tier, the disk tier, and the
disk tier after a restart in a new process are identical to recomputing everything, and
the last prompt token's logits agree within 1e-4 (absolute; logits have std ~1).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine_adapter.runner.model import LlamaModel
from engine_adapter.runner.model_config import LlamaConfig
from engine_adapter.runner.runner import KVStrataLLM
from engine_adapter.runner.weights import init_random_weights
from kvstore import ConfigError, InvalidInputError, KVCacheStore, KVLayout, LayoutMismatchError, StoreConfig
from tests import ROOT
from tests.conftest import POOL_DEVICE
from tiers.keys import TierKind

ATOL = 1e-4
BLOCK = 4
CONFIG = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=192, num_layers=2, num_heads=6,
                     num_kv_heads=2, max_position=4096)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return init_random_weights(LlamaModel(CONFIG, device=POOL_DEVICE), seed=1)


def store_config(path: Path, pool_blocks: int = 64, cpu_blocks: int = 64) -> StoreConfig:
    layout = CONFIG.kv_layout
    return StoreConfig(layout, block_size=BLOCK, namespace="fidelity", pool_blocks=pool_blocks, pool_device=POOL_DEVICE,
                       cpu_bytes=cpu_blocks * layout.block_bytes(BLOCK), disk_path=str(path / "disk"),
                       disk_bytes=64 << 20, disk_sync=False,
                       load_policy="always")  # these tests check each tier's hits, not the load policy


def prompts_sharing_prefix(seed: int, prefix_len: int = 37, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, CONFIG.vocab_size, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(1, CONFIG.vocab_size, (5 + i,), generator=g).tolist() for i in range(n)]


def baseline(model: LlamaModel, tmp: Path, prompts: list[list[int]], max_new: int) -> list:  # type: ignore[type-arg]
    with KVCacheStore(store_config(tmp / "baseline")) as store:
        return KVStrataLLM(model, store, prefix_caching=False).generate(prompts, max_new)


def place(store: KVCacheStore, where: TierKind) -> None:
    """Move every cached block down so that `where` is the fastest tier holding it."""
    pool, cpu, _ = store.tiers
    if where in (TierKind.CPU, TierKind.DISK):
        pool.spill()
        pool.clear()
    if where is TierKind.DISK:
        cpu.spill()
        cpu.clear()


@pytest.mark.parametrize("where", [TierKind.POOL, TierKind.CPU, TierKind.DISK])
@pytest.mark.parametrize("seed", [0, 1])
def test_generation_with_store_equals_without(model: LlamaModel, tmp_path: Path, where: TierKind, seed: int) -> None:
    prompts = prompts_sharing_prefix(seed)
    expected = baseline(model, tmp_path, prompts, max_new=6)
    with KVCacheStore(store_config(tmp_path)) as store:
        llm = KVStrataLLM(model, store)
        first = llm.generate(prompts[:1], 6)[0]  # computes and caches the shared prefix
        assert first.stats.num_cached_tokens == 0
        assert first.token_ids == expected[0].token_ids
        for prompt, exp in zip(prompts[1:], expected[1:]):
            place(store, where)
            got = llm.generate([prompt], 6)[0]
            assert got.stats.cached_tokens_per_tier.get(where.value, 0) >= 32, got.stats
            assert got.stats.num_prefill_tokens == len(prompt) - got.stats.num_cached_tokens
            assert got.token_ids == exp.token_ids
            torch.testing.assert_close(got.prefill_logits, exp.prefill_logits, atol=ATOL, rtol=0)
        store.check_integrity()


def test_batched_requests_sharing_a_prefix_hit_the_pool(model: LlamaModel, tmp_path: Path) -> None:
    prompts = prompts_sharing_prefix(7, n=4)
    expected = baseline(model, tmp_path, prompts, max_new=5)
    with KVCacheStore(store_config(tmp_path)) as store:
        llm = KVStrataLLM(model, store)
        llm.generate(prompts[:1], 5)
        got = llm.generate(prompts[1:], 5)  # one wave: decoded together
        for g, e in zip(got, expected[1:]):
            assert g.token_ids == e.token_ids
            assert g.stats.source == "pool"
        # A repeat of the same prompt reuses its decoded blocks too (cached during decode).
        again = llm.generate(prompts[1:2], 5)[0]
        assert again.stats.num_cached_tokens >= (len(prompts[1]) - 1) // BLOCK * BLOCK


def test_small_pool_serves_later_requests_from_lower_tiers(model: LlamaModel, tmp_path: Path) -> None:
    """Working set larger than the pool and the CPU tier: prefixes come back from below."""
    docs = [prompts_sharing_prefix(20 + d, prefix_len=41, n=2) for d in range(4)]
    flat = [p for pair in docs for p in pair]
    expected = baseline(model, tmp_path, flat, max_new=3)
    with KVCacheStore(store_config(tmp_path, pool_blocks=16, cpu_blocks=12)) as store:
        llm = KVStrataLLM(model, store)
        for pair in docs:  # first question of every document
            llm.generate(pair[:1], 3)
        tiers_seen = set()
        for d, pair in enumerate(docs):  # second questions, oldest document first
            got = llm.generate(pair[1:], 3)[0]
            assert got.token_ids == expected[2 * d + 1].token_ids
            tiers_seen |= set(got.stats.cached_tokens_per_tier)
        assert {"cpu", "disk"} & tiers_seen, tiers_seen
        store.check_integrity()


_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from tests.conftest import POOL_DEVICE
    from tests.engine_adapter.runner.test_runner import CONFIG, store_config
    from engine_adapter.runner.model import LlamaModel
    from engine_adapter.runner.runner import KVStrataLLM
    from engine_adapter.runner.weights import init_random_weights
    from kvstore import KVCacheStore

    path, prompt = Path(sys.argv[1]), json.loads(sys.argv[2])
    model = init_random_weights(LlamaModel(CONFIG, device=POOL_DEVICE), seed=1)
    with KVCacheStore(store_config(path)) as store:
        res = KVStrataLLM(model, store).generate([prompt], 6)[0]
    print(json.dumps({"tokens": res.token_ids, "tiers": res.stats.cached_tokens_per_tier,
                      "logits": res.prefill_logits.tolist()}))
    """
)


def test_prefix_from_disk_after_restart(model: LlamaModel, tmp_path: Path) -> None:
    prompts = prompts_sharing_prefix(3)
    expected = baseline(model, tmp_path, prompts, max_new=6)
    with KVCacheStore(store_config(tmp_path)) as store:  # process 1 caches, closes (persists)
        KVStrataLLM(model, store).generate(prompts[:1], 6)
    root = ROOT
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(prompts[1])], cwd=root,
                         capture_output=True, text=True, check=True, timeout=300)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["tiers"] == {"disk": 36}  # the 9 full blocks of the 37-token shared prefix, from disk
    assert child["tokens"] == expected[1].token_ids
    torch.testing.assert_close(torch.tensor(child["logits"]), expected[1].prefill_logits, atol=ATOL, rtol=0)


def test_runner_rejects_bad_setups_and_inputs(model: LlamaModel, tmp_path: Path) -> None:
    no_pool = StoreConfig(CONFIG.kv_layout, block_size=BLOCK, cpu_bytes=1 << 20)
    with KVCacheStore(no_pool) as store, pytest.raises(ConfigError, match="block pool"):
        KVStrataLLM(model, store)
    other = StoreConfig(KVLayout(3, 2, 16, torch.float32), block_size=BLOCK, pool_blocks=8, pool_device=POOL_DEVICE,
                        cpu_bytes=0)
    with KVCacheStore(other) as store, pytest.raises(LayoutMismatchError, match="KV layout"):
        KVStrataLLM(model, store)
    with KVCacheStore(store_config(tmp_path, pool_blocks=8)) as store:
        llm = KVStrataLLM(model, store)
        with pytest.raises(InvalidInputError, match="empty"):
            llm.generate([[]], 2)
        with pytest.raises(InvalidInputError, match="vocab_size"):
            llm.generate([[CONFIG.vocab_size]], 2)
        with pytest.raises(InvalidInputError, match="blocks"):
            llm.generate([list(range(1, 40))], 2)  # 8 blocks of 4 cannot hold 41 tokens
        with pytest.raises(InvalidInputError, match="max_new_tokens"):
            llm.generate([[1, 2]], 0)
        store.check_integrity()
        assert len(store.pool.free_queue) == 8  # nothing leaked by the failures
