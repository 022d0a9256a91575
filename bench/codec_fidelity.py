"""Codec fidelity on the reference runner: the first token after a lossy cache hit against the
same hit with exact KV.

Run: `kvstrata bench codec-fidelity [--contexts 1024,4096,32768] [--prompts 8]`. For each
context length and prompt, the runner's model prefills a random prefix once into a paged
cache; then, per codec, the prefix's full blocks go through the codec (encode, decode into
a copy of the cache), the model prefills a fresh suffix of `SUFFIX` tokens over them, and
the suffix's last logits are compared with the exact hit's (raw KV): the difference of the
log-probability of the exact hit's greedy token, whether the greedy token agrees, and the
KL divergence. For contexts up to `RECOMPUTE_MAX` the table also shows the exact hit against
a full recompute of prefix + suffix in one pass: the numeric noise that caching without any
codec already adds. Distributions are over prompts (median, p90, max), not only means.

The model is a random-weight Llama in bfloat16 with real-model head size (128) and shaped
statistics: query and key projections scaled so attention is peaked (score std ~3, not the
near-uniform attention of small random weights that would hide KV error), four key channels
per head scaled 10x (the outlier channels real keys have), and an LM head giving logits of
std ~3 (a peaked next-token distribution, not near-ties). What it cannot tell: the error's
effect on real attention patterns (sinks, induction heads) and on task accuracy; the
distribution of real K/V beyond the outlier channels. The vLLM measurement in
docs/performance.md compares real vLLM hits, on random weights as well.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import click
import torch

from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results
from cli.progress import tqdm

BLOCK_SIZE = 16
SUFFIX = 32  # new tokens after the cached prefix (a question after a document)
RECOMPUTE_MAX = 4096  # longest context also prefilled in one pass, for the noise floor
OUTLIER_CHANNELS = (10, 74, 50, 114)  # two RoPE pairs (i, i + 64) per key head
CODECS = ("zstd", "int8", "fp8", "k8v4")


def fidelity_model(max_tokens: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """The shaped random-weight Llama described in the module docstring."""
    from engine_adapter.runner.model import LlamaModel
    from engine_adapter.runner.model_config import LlamaConfig
    from engine_adapter.runner.weights import init_random_weights

    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=128, max_position=max_tokens + 64, dtype=torch.bfloat16)
    model = init_random_weights(LlamaModel(config), seed=seed)
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(4)
            attn.k_proj.weight.mul_(4)
            rows = attn.k_proj.weight.view(config.num_kv_heads, 128, -1)
            rows[:, list(OUTLIER_CHANNELS)] *= 10
        model.lm_head.weight.mul_(10)
    return model


def _forward(model, cache: torch.Tensor, tokens: Sequence[int], start: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.forward_batch import ForwardBatch, RequestChunk

    blocks = list(range(cache.shape[2]))
    batch = ForwardBatch.build([RequestChunk(list(tokens), start, blocks)], BLOCK_SIZE)
    return model(batch, cache)[0].float().log_softmax(-1)  # type: ignore[no-any-return]


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Log-probability difference of `ref`'s greedy token, greedy agreement, KL(ref || got)."""
    top = int(ref.argmax())
    return {"dlogp": abs(float(got[top] - ref[top])), "agree": float(int(got.argmax()) == top),
            "kl": float((ref.exp() * (ref - got)).sum())}


def one_prompt(model, n: int, seed: int, codecs: Sequence[str]) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.paged_attention import allocate_kv_cache
    from tiers.codecs import build_codec, parse_codec

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.config.vocab_size, (n + SUFFIX,), generator=g).tolist()
    layout = model.config.kv_layout
    num_blocks = -(-(n + SUFFIX) // BLOCK_SIZE)
    cache = allocate_kv_cache(layout, num_blocks, BLOCK_SIZE)
    _forward(model, cache, tokens[:n], 0)
    prefix = cache.clone()
    ref = _forward(model, cache, tokens[n:], n)
    out: dict[str, dict[str, float]] = {}
    if n <= RECOMPUTE_MAX:
        once = allocate_kv_cache(layout, num_blocks, BLOCK_SIZE)
        out["recompute"] = compare(ref, _forward(model, once, tokens, 0))
    for name in codecs:
        codec = build_codec(parse_codec(name), layout.block_shape(BLOCK_SIZE), layout.dtype)
        cache = prefix.clone()
        err = scale = stored = 0.0
        for b in range(n // BLOCK_SIZE):  # the prefix's full blocks, as a hit loads them
            block = prefix[:, :, b]
            payload = codec.encode(block)
            assert payload is not None
            stored += len(payload)
            codec.decode(payload, cache[:, :, b])
            err += float((cache[:, :, b].float() - block.float()).abs().mean())
            scale += float(block.float().abs().mean())
        raw = n // BLOCK_SIZE * layout.block_bytes(BLOCK_SIZE)
        out[name] = {**compare(ref, _forward(model, cache, tokens[n:], n)), "kv_rel_err": err / max(scale, 1e-30),
                     "smaller": raw / stored}
    return out


def _rank(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of sorted `values`."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    d = sorted(s["dlogp"] for s in samples)
    kl = sorted(s["kl"] for s in samples)
    return {"prompts": len(samples), "dlogp_median": statistics.median(d), "dlogp_p90": _rank(d, 0.9),
            "dlogp_max": d[-1], "dlogp_mean": statistics.fmean(d),
            "agree": statistics.fmean(s["agree"] for s in samples),
            "kl_median": statistics.median(kl), "kl_max": kl[-1],
            "kv_rel_err": statistics.fmean(s.get("kv_rel_err", 0.0) for s in samples)}


def run(contexts: Sequence[int], prompts: int, codecs: Sequence[str]) -> dict[str, object]:
    torch.manual_seed(0)
    model = fidelity_model(max(contexts) + SUFFIX)
    per: dict[str, dict[str, list[dict[str, float]]]] = {}
    t0 = time.perf_counter()
    jobs = [(n, p) for n in contexts
            for p in range(prompts if n <= RECOMPUTE_MAX else max(2, prompts * RECOMPUTE_MAX // n))]
    for n, p in tqdm(jobs, desc="prompts"):
        for name, sample in one_prompt(model, n, 1000 * n + p, codecs).items():
            per.setdefault(name, {}).setdefault(str(n), []).append(sample)
    rows, summary = [], {}
    for name, by_n in per.items():
        summary[name] = {}
        for n, samples in by_n.items():
            s = summary[name][n] = summarize(samples)
            rows.append([name, n, s["prompts"], f"{s['dlogp_median']:.4f}", f"{s['dlogp_p90']:.4f}",
                         f"{s['dlogp_max']:.4f}", f"{s['agree']:.3f}", f"{s['kl_max']:.2e}", f"{s['kv_rel_err']:.4f}"])
        all_samples = [x for v in by_n.values() for x in v]
        summary[name]["all"] = summarize(all_samples)
    print_table("First token after a hit: codec against the exact hit (reference runner, bf16 KV)",
                ["variant", "context", "prompts", "|dlogp| p50", "p90", "max", "greedy agree", "KL max",
                 "KV rel err"], rows)
    return {"contexts": list(contexts), "prompts": prompts, "suffix": SUFFIX, "block_size": BLOCK_SIZE,
            "seconds": time.perf_counter() - t0, "summary": summary,
            "samples": {k: v for k, v in per.items()}}


@click.command("codec-fidelity", help=__doc__, context_settings=CONTEXT)
@click.option("--contexts", default="1024,2048,4096,8192,16384,32768", show_default=True,
              help="Context lengths (tokens), comma-separated; those above 4096 get proportionally fewer "
                   "prompts (at least 2).")
@click.option("--prompts", type=int, default=16, show_default=True, help="Prompts per context up to 4096 tokens.")
@click.option("--codecs", default=",".join(CODECS), show_default=True, help="Codecs to compare, comma-separated.")
def command(contexts: str, prompts: int, codecs: str) -> None:
    ctx = [int(c) for c in contexts.split(",") if c]
    write_results("codec_fidelity", run(ctx, prompts, [c for c in codecs.split(",") if c]))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench codec-fidelity")


if __name__ == "__main__":
    raise SystemExit(main())
