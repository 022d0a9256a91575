"""A tiny random-weight Llama and a word-level tokenizer, built locally (no download).

Used by the vLLM integration tests and the long-document benchmark: vLLM loads it like
any Hugging Face checkpoint. Weights are seeded, so two builds are identical.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

WORD_PREFIX = "w"


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the model. `head_dim` = hidden_size / num_heads must suit vLLM's CPU attention."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 8192
    seed: int = 0
    initializer_range: float = 0.2  # wide logits: greedy decoding without near-ties

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"inconsistent head counts in {self}")


def build_tiny_llama(path: str | os.PathLike[str], spec: TinyLlamaSpec | None = None) -> str:
    """Write config, seeded random weights and a tokenizer under `path`; return the path.

    Idempotent: an existing build with the same spec is reused.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyLlamaSpec()
    path = os.fspath(path)
    stamp = os.path.join(path, "tiny_spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == asdict(spec):
                return path
    os.makedirs(path, exist_ok=True)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)

    save_word_tokenizer(path, spec.vocab_size)
    with open(stamp, "w") as f:
        json.dump(asdict(spec), f)
    return path


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """Save under `path` a word-level tokenizer: id `i >= 3` is the word `w<i>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"{WORD_PREFIX}{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def words(token_ids: list[int]) -> str:
    """The text that the tiny tokenizer turns back into exactly `token_ids`."""
    return " ".join(f"{WORD_PREFIX}{t}" for t in token_ids)


def build_tiny_lora(path: str | os.PathLike[str], seed: int, spec: TinyLlamaSpec | None = None, rank: int = 8) -> str:
    """Write a random LoRA adapter (PEFT format: q_proj and v_proj of every layer) for the
    tiny Llama under `path`; return the path. Different seeds give different adapters."""
    import torch
    from safetensors.torch import save_file

    spec = spec or TinyLlamaSpec()
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    head_dim = spec.hidden_size // spec.num_heads
    outs = {"q_proj": spec.hidden_size, "v_proj": spec.num_kv_heads * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, spec.hidden_size, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.5
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(outs), "task_type": "CAUSAL_LM", "base_model_name_or_path": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path
