"""A decoder-only Llama-family transformer whose attention runs over a paged KV cache.

Module and parameter names follow Hugging Face's `LlamaForCausalLM` with the `model.`
prefix dropped (`layers.0.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`), so a
HF state dict maps by name (see `engine_adapter.runner.weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_adapter.runner.forward_batch import ForwardBatch
from engine_adapter.runner.model_config import LlamaConfig
from engine_adapter.runner.paged_attention import check_kv_cache, paged_attention
from engine_adapter.runner.rope import apply_rotary, inverse_frequencies, rotary_cos_sin
from kvstore.errors import InvalidInputError


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square taken in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; K/V go through the paged cache."""

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        head_dim = config.head_dim
        assert head_dim is not None
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            head_dim,
        )
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attend `x` `[num_tokens, hidden]`; writes this layer's new K/V into `kv_cache`."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, kv_cache, self.layer, batch, self.scale)
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch, kv_cache)
        mlp: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class LlamaModel(nn.Module):
    """Embeddings, `num_layers` decoder layers, final norm and LM head.

    Construction allocates parameters in `config.dtype` on `device`, uninitialized; fill
    them with `engine_adapter.runner.weights.init_random_weights` or `load_hf_checkpoint`.
    With `tie_word_embeddings` the LM head shares the embedding matrix.
    """

    def __init__(self, config: LlamaConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):  # skip torch's default init: the weights come later
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(config.dtype).to_empty(device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(config).to(device), persistent=False)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states `[num_tokens, hidden]` of every fed token.

        Writes the fed tokens' K/V of every layer into their slots of `kv_cache`; reads the
        rest of each request's context from its blocks. Nothing else is modified.

        Raises:
            LayoutMismatchError: `kv_cache` does not have the model's KV layout.
            InvalidInputError: a position beyond `max_position`, or a block id out of range.
        """
        check_kv_cache(kv_cache, self.config.kv_layout, batch)
        if max(batch.context_lens) > self.config.max_position:
            raise InvalidInputError(
                f"context of {max(batch.context_lens)} tokens exceeds max_position="
                f"{self.config.max_position}"
            )
        inv_freq = self.inv_freq
        assert isinstance(inv_freq, torch.Tensor)  # a registered buffer
        cos_sin = rotary_cos_sin(batch.positions, inv_freq)
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, cos_sin, batch, kv_cache)
        normed: torch.Tensor = self.norm(x)
        return normed

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits `[n, vocab_size]` (float32) of hidden states `[n, hidden]`."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.to(torch.float32)

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits `[num_reqs, vocab_size]` (float32) of each request's last fed token.

        Same effect on `kv_cache` as `hidden_states`.
        """
        hidden = self.hidden_states(batch, kv_cache)
        return self.compute_logits(hidden[batch.last_token_indices])
