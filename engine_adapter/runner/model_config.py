"""Frozen, validated configuration of a Llama-family decoder, and its Hugging Face mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.config import KVLayout
from kvstore.errors import ConfigError

# Activations the model computes in; the KV cache is held in the same dtype.
_MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_model_dtype(value: torch.dtype | str) -> torch.dtype:
    """The torch dtype named by `value` ('bfloat16', 'torch.float32', a torch.dtype)."""
    if isinstance(value, torch.dtype) and value in _MODEL_DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _MODEL_DTYPES:
        return _MODEL_DTYPES[value.removeprefix("torch.")]
    raise ConfigError(f"model dtype must be one of {sorted(_MODEL_DTYPES)}, got {value!r}")


def _check_positive(owner: str, name: str, value: object, kind: type = int) -> None:
    bad_type = isinstance(value, bool) or not isinstance(
        value, (int, float) if kind is float else int
    )
    if bad_type or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (HF `rope_type: "llama3"`).

    Wavelengths longer than `original_max_position / low_freq_factor` are stretched by
    `factor`, those shorter than `original_max_position / high_freq_factor` are kept, and
    the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_positive("Llama3RopeScaling", name, getattr(self, name), float)
        _check_positive("Llama3RopeScaling", "original_max_position", self.original_max_position)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"Llama3RopeScaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a decoder-only Llama-family transformer, validated at construction.

    `head_dim` defaults to `hidden_size // num_heads`; `dtype` (a torch dtype or its name)
    is the dtype of weights, activations and the paged KV cache.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position: int = 2048
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        for name in (*names, "num_kv_heads", "max_position"):
            _check_positive("LlamaConfig", name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"LlamaConfig.hidden_size={self.hidden_size} is not a multiple of "
                    f"num_heads={self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive("LlamaConfig", "head_dim", self.head_dim)
        if int(self.head_dim or 0) % 2:  # checked positive just above
            raise ConfigError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        _check_positive("LlamaConfig", "rms_norm_eps", self.rms_norm_eps, float)
        _check_positive("LlamaConfig", "rope_theta", self.rope_theta, float)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ConfigError(
                f"LlamaConfig.rope_scaling must be a Llama3RopeScaling or None, "
                f"got {self.rope_scaling!r}"
            )
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(
                f"LlamaConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}"
            )
        object.__setattr__(self, "dtype", parse_model_dtype(self.dtype))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_layout(self) -> KVLayout:
        """The layout of one token's KV, as the store and the block pool see it."""
        return KVLayout(self.num_layers, self.num_kv_heads, int(self.head_dim or 0), self.dtype)

    @classmethod
    def from_hf_dict(
        cls, hf: Mapping[str, Any], dtype: torch.dtype | str | None = None
    ) -> LlamaConfig:
        """Build from a Hugging Face Llama `config.json` dict (old and new RoPE key styles).

        `dtype` overrides the checkpoint's `dtype`/`torch_dtype` (default float32).

        Raises:
            ConfigError: not a Llama config, an unsupported feature (biases, activation,
                RoPE type), or a missing/invalid value.
        """
        if hf.get("model_type", "llama") != "llama":
            raise ConfigError(f"expected model_type 'llama', got {hf.get('model_type')!r}")
        for key, expected in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("mlp_bias", False),
        ):
            if hf.get(key, expected) != expected:
                raise ConfigError(
                    f"unsupported Llama config: {key}={hf[key]!r} (need {expected!r})"
                )
        # transformers>=5 nests RoPE settings in `rope_parameters`; older files use
        # top-level `rope_theta` plus an optional `rope_scaling` dict.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            try:
                scaling = Llama3RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position=int(rope["original_max_position_embeddings"]),
                )
            except KeyError as e:
                raise ConfigError(f"llama3 rope scaling lacks {e.args[0]!r}") from None
        elif rope_type != "default":
            raise ConfigError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
        try:
            num_heads = hf["num_attention_heads"]
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim"),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position=hf.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                dtype=parse_model_dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or torch.float32),
            )
        except KeyError as e:
            raise ConfigError(f"Llama config lacks {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `LlamaConfig` keyword arguments describing this model."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope.update(
                rope_type="llama3",
                factor=s.factor,
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position,
            )
        return {
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }
