"""Filling a `LlamaModel`'s weights: seeded random init, or a local Hugging Face checkpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine_adapter.runner.model import LlamaModel
from engine_adapter.runner.model_config import LlamaConfig
from kvstore.errors import ConfigError

# Checkpoint entries that carry no weights of ours (old HF files saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ConfigError):
    """A checkpoint directory is incomplete or does not match its config."""


@torch.no_grad()
def init_random_weights(model: LlamaModel, seed: int, std: float = 0.02, *, on_device: bool = False) -> LlamaModel:
    """Overwrite every weight: matrices ~ N(0, std), norm weights = 1; returns `model`.

    Values are drawn in float32 on the CPU from `seed`, so they are the same on every device
    and (up to rounding) in every dtype. With `on_device` they are drawn on the model's
    device instead (seconds rather than minutes for an 8B model on a GPU; the values then
    depend on the device's generator).
    """
    device = model.device if on_device else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return model


def hf_to_local_name(hf_name: str) -> str:
    """Our parameter name for a HF `LlamaForCausalLM` one (`model.x` -> `x`)."""
    return hf_name.removeprefix("model.")


def load_hf_checkpoint(
    path: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """Build a `LlamaModel` from a local HF Llama directory (`config.json` + `*.safetensors`).

    `dtype` overrides the checkpoint's dtype (default: the config's, else float32). Shards
    are read one tensor at a time and cast on copy. Nothing is downloaded.

    Raises:
        CheckpointError: no config.json or safetensors file, unexpected or missing weights,
            or a weight of the wrong shape.
        ConfigError: the config describes an unsupported model.
    """
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("loading checkpoints needs `pip install safetensors`") from e
    root = Path(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root} has no config.json")
    config = LlamaConfig.from_hf_dict(json.loads((root / "config.json").read_text()), dtype=dtype)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors file")
    model = LlamaModel(config, device=device)
    load_hf_weights(model, _read_safetensors(files, safe_open), source=str(root))
    return model


def _read_safetensors(files: list[Path], safe_open: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_hf_weights(
    model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "state dict"
) -> None:
    """Copy HF-named `(name, tensor)` pairs into `model`, casting to its dtype and device.

    Every parameter must be given exactly once (with tied embeddings a `lm_head.weight`
    entry is skipped); `source` names the origin in error messages.

    Raises:
        CheckpointError: an unexpected name, a wrong shape, or a parameter never given;
            parameters copied before the error keep their new values.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        name = hf_to_local_name(hf_name)
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied: the embedding matrix is the head
        if name not in params:
            raise CheckpointError(f"{source}: unexpected weight {hf_name!r}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"{source}: {hf_name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(params[name].shape)}"
            )
        params[name].copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing weights {missing[:5]}{more}")
