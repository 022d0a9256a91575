"""Prefill and decode speed of `engine_adapter.runner.model` with a Llama-3-8B attention shape.

The model has Llama-3-8B's layer shape (hidden 4096, 32 query heads, 8 KV heads of 128,
MLP 14336, llama3 RoPE) but only `--layers` layers and a small vocabulary, with random
weights. Per-layer time scales to the full 32 layers roughly linearly (embedding and LM
head are negligible at these sizes). Run: `python -m bench.model_speed --layers 1`.
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import torch

from engine_adapter.runner.forward_batch import ForwardBatch, RequestChunk
from engine_adapter.runner.model import LlamaModel
from engine_adapter.runner.model_config import Llama3RopeScaling, LlamaConfig
from engine_adapter.runner.paged_attention import allocate_kv_cache
from engine_adapter.runner.weights import init_random_weights

BLOCK_SIZE = 16


def llama3_8b_shape(num_layers: int, dtype: torch.dtype | str = torch.float32,
                    max_position: int = 131072) -> LlamaConfig:
    """Llama-3-8B's layer shape with `num_layers` layers and a 1024-token vocabulary."""
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(),
        max_position=max_position,
        dtype=dtype,
    )


class SpeedResult(NamedTuple):
    """One timed forward step of a single request."""

    kind: str  # "prefill" (cached_tokens == 0), "suffix" (prefix KV cached) or "decode"
    cached_tokens: int  # KV already in blocks before the step
    new_tokens: int  # tokens fed in the step
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds


def time_step(
    model: LlamaModel, kv_cache: torch.Tensor, cached_tokens: int, new_tokens: int, repeats: int
) -> float:
    """Best-of-`repeats` seconds of one forward of `new_tokens` after `cached_tokens`.

    The cached prefix's KV is whatever the cache holds (its values do not affect speed).
    """
    table = list(range(-(-(cached_tokens + new_tokens) // BLOCK_SIZE)))
    tokens = torch.randint(model.config.vocab_size, (new_tokens,)).tolist()
    batch = ForwardBatch.build([RequestChunk(tokens, cached_tokens, table)], BLOCK_SIZE)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(batch, kv_cache)
        best = min(best, time.perf_counter() - start)
    return best


def measure(
    num_layers: int,
    prefill_lens: list[int],
    suffix: tuple[int, int] | None,
    decode_contexts: list[int],
    dtype: torch.dtype | str,
    repeats: int = 2,
) -> list[SpeedResult]:
    """Time full prefills, one prefix-cached suffix prefill and decode steps."""
    config = llama3_8b_shape(num_layers, dtype)
    model = init_random_weights(LlamaModel(config), seed=0)
    longest = max([*prefill_lens, sum(suffix or (0, 0)), *(c + 1 for c in decode_contexts)])
    kv_cache = allocate_kv_cache(config.kv_layout, -(-longest // BLOCK_SIZE), BLOCK_SIZE)
    time_step(model, kv_cache, 0, 64, 1)  # warm-up
    results = [
        SpeedResult("prefill", 0, n, time_step(model, kv_cache, 0, n, repeats))
        for n in prefill_lens
    ]
    if suffix is not None:
        cached, new = suffix
        results.append(
            SpeedResult("suffix", cached, new, time_step(model, kv_cache, cached, new, repeats))
        )
    for context in decode_contexts:
        results.append(SpeedResult("decode", context, 1, time_step(model, kv_cache, context, 1, 5)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, nargs="*", default=[256, 1024, 4096])
    parser.add_argument(
        "--suffix", type=int, nargs=2, default=[4096, 256], metavar=("CACHED", "NEW")
    )
    parser.add_argument("--decode", type=int, nargs="*", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"{args.layers} layer(s) of the Llama-3-8B shape"
    )
    results = measure(
        args.layers, args.prefill, tuple(args.suffix), args.decode, args.dtype, args.repeats
    )
    print(
        f"{'kind':8} {'cached':>7} {'new':>6} {'seconds':>8} {'tok/s':>9} {'tok/s @32 layers':>17}"
    )
    for r in results:
        full = r.tokens_per_s * args.layers / 32
        print(
            f"{r.kind:8} {r.cached_tokens:7d} {r.new_tokens:6d} {r.seconds:8.3f} "
            f"{r.tokens_per_s:9.1f} {full:17.2f}"
        )


if __name__ == "__main__":
    main()
