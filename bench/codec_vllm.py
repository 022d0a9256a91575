"""Codec fidelity in real vLLM: the first token after a kvstrata hit through a codec against
vLLM's own prefix-cache hit of the same prompt.

Run with `.venv-vllm`'s Python, under the machine's vLLM lock:
`flock /tmp/kvstrata-vllm.lock .venv-vllm/bin/kvstrata bench codec-vllm [--contexts 1024,4096]`.
One fresh engine process per codec (bfloat16 KV, a random-weight Llama with head size 64,
the connector with a disk tier and no CPU tier, so every kvstrata hit is decoded from disk).
For each prompt: a first request computes it (the connector writes its blocks through to
disk), a second is vLLM's prefix-cache hit (the reference), then vLLM's cache is reset and a
third is kvstrata's hit. Compared: the log-probability of the reference's greedy token
(missing from the top 20 counts as the 20th's), greedy agreement. With "none" the kvstrata
hit must equal vLLM's exactly: the comparison's noise floor.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import click

from bench.tiny_model import TinyLlamaSpec, build_tiny_llama
from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results

BLOCK = 32
SUFFIX = 32
TOP = 20
MODEL = TinyLlamaSpec(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_positions=16384, initializer_range=0.1)


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine with `spec["codec"]` on its disk tier; per prompt the reference and kvstrata
    first-token log-probabilities."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="TierKVConnector", kv_connector_module_path="engine_adapter.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes": 0, "disk_path": spec["disk"], "disk_bytes": "2GiB",
                                   "disk_codec": spec["codec"], "write_through": True, "async_saves": False,
                                   "load_policy": "always"},
        kv_load_failure_policy="recompute")
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=BLOCK, dtype="bfloat16", seed=0,
              max_model_len=max(spec["contexts"]) + SUFFIX + BLOCK, kv_transfer_config=transfer)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)

    def first(ids: list[int]) -> tuple[dict[int, float], int]:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        lps = out.outputs[0].logprobs[0]
        return {int(t): float(lp.logprob) for t, lp in lps.items()}, int(out.num_cached_tokens or 0)

    samples = []
    for n in spec["contexts"]:
        for p in range(spec["prompts"]):
            seed = 7919 * n + p
            ids = [3 + (seed * 104729 + i * 7919 + (i * i) % 997) % (MODEL.vocab_size - 3) for i in range(n + SUFFIX)]
            first(ids)  # computed; its blocks go to disk
            ref, ref_cached = first(ids)  # vLLM's own prefix-cache hit
            llm.reset_prefix_cache()
            got, got_cached = first(ids)  # kvstrata's hit, decoded from disk
            llm.reset_prefix_cache()
            samples.append({"context": n, "ref": ref, "got": got, "ref_cached": ref_cached, "got_cached": got_cached})
    return {"codec": spec["codec"], "samples": samples}


def compare(sample: dict[str, Any]) -> dict[str, float]:
    ref = {int(k): v for k, v in sample["ref"].items()}
    got = {int(k): v for k, v in sample["got"].items()}
    top = max(ref, key=ref.__getitem__)
    floor = min(got.values())
    return {"dlogp": abs(got.get(top, floor) - ref[top]), "agree": float(max(got, key=got.__getitem__) == top),
            "missing": float(top not in got)}


def run(contexts: list[int], prompts: int, codecs: list[str]) -> dict[str, object]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-codec-vllm-") as work:
        model = build_tiny_llama(os.path.join(work, "model"), MODEL)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "TOKENIZERS_PARALLELISM": "false"}
        for codec in codecs:
            spec = {"model": model, "codec": codec, "disk": os.path.join(work, f"kv-{codec}"), "contexts": contexts,
                    "prompts": prompts}
            proc = subprocess.run([sys.executable, "-m", "bench.codec_vllm", "--engine", json.dumps(spec)], env=env,
                                  capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"engine for {codec} failed:\n{proc.stderr[-4000:]}")
            results[codec] = json.loads(proc.stdout.strip().splitlines()[-1])["samples"]
    rows, summary = [], {}
    for codec, samples in results.items():
        summary[codec] = {}
        for n in contexts:
            cmp = [compare(s) for s in samples if s["context"] == n]
            d = sorted(c["dlogp"] for c in cmp)
            cached = [s["got_cached"] for s in samples if s["context"] == n]
            s = summary[codec][str(n)] = {
                "prompts": len(cmp), "dlogp_median": statistics.median(d),
                "dlogp_p90": d[max(0, math.ceil(0.9 * len(d)) - 1)],
                "dlogp_max": d[-1], "agree": statistics.fmean(c["agree"] for c in cmp),
                "missing": sum(c["missing"] for c in cmp), "kvstrata_cached_min": min(cached)}
            rows.append([codec, n, s["prompts"], f"{s['dlogp_median']:.4f}", f"{s['dlogp_p90']:.4f}",
                         f"{s['dlogp_max']:.4f}", f"{s['agree']:.3f}", s["kvstrata_cached_min"]])
    print_table("vLLM: first token after a kvstrata hit through each codec against vLLM's own prefix hit",
                ["codec", "context", "prompts", "|dlogp| p50", "p90", "max", "greedy agree", "min cached tokens"], rows)
    return {"contexts": contexts, "prompts": prompts, "suffix": SUFFIX, "model": MODEL.__dict__, "summary": summary,
            "samples": results}


@click.command("codec-vllm", help=__doc__, context_settings=CONTEXT)
@click.option("--contexts", default="1024,4096,8192", show_default=True, help="Context lengths, comma-separated.")
@click.option("--prompts", type=int, default=8, show_default=True, help="Prompts per context.")
@click.option("--codecs", default="none,int8,fp8,k8v4", show_default=True, help="Codecs, comma-separated.")
@click.option("--engine", "engine_spec", default=None, hidden=True, help="Internal: run one engine (JSON spec).")
def command(contexts: str, prompts: int, codecs: str, engine_spec: str | None) -> None:
    if engine_spec is not None:
        print("\n" + json.dumps(engine(json.loads(engine_spec))), flush=True)
        os._exit(0)  # skip vLLM's slow interpreter teardown
    ctx = [int(c) for c in contexts.split(",") if c]
    write_results("codec_vllm", run(ctx, prompts, [c for c in codecs.split(",") if c]))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench codec-vllm")


if __name__ == "__main__":
    raise SystemExit(main())
