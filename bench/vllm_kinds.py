"""Each kind of model through vLLM (CPU) with kvstrata: a repeated prompt's TTFT against
recomputing it, and the bytes kvstrata stores per prompt token.

Kinds: the tiny random models of `bench/tiny_arch.py` with vLLM's hybrid KV cache manager on
(Gemma 3, gpt-oss, Llama 4, Qwen3-Next), DeepSeek-V3 MLA, and the tiny Llama at tensor and
pipeline parallel size 2. Each kind runs in an engine process of its own: the prompt once
(computed and stored), then `--rounds` pairs A/B interleaved (the order alternates): vLLM's own
cache reset and the prompt served by kvstrata (A); reset, and the same prompt with
`skip_reading_prefix_cache` (B: recomputed, neither vLLM's cache nor kvstrata read). TTFT is the
wall time of a one-token `generate`. Bytes per prompt token: every group's newly stored bytes
over the prompt's tokens. For the windowed kinds a second engine runs with vLLM's hybrid
manager off (every layer full-length, one group): what the window saves.

`.venv-vllm/bin/python -m bench.vllm_kinds [--kinds gemma3,mla] [--tokens 2048] [--rounds 5]`
prints a table and writes `results/vllm_kinds.json`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import click

from cli.args import CONTEXT, positive
from cli.output import RESULTS_DIR, machine, print_table

_SHM = "/dev/shm/vllm_dist_*"
_CHUNKED = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
_TWO_CPUS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# kind -> (tiny model, LLM arguments, environment, windowed: also measured with the hybrid manager off)
KINDS: dict[str, tuple[str, dict[str, Any], dict[str, str], bool]] = {
    "gemma3": ("gemma3", {}, {}, True),
    "gpt_oss": ("gpt_oss", {}, {}, True),
    "llama4": ("llama4", {}, _CHUNKED, True),
    "qwen3_next": ("qwen3_next", {"block_size": None}, {}, False),
    "mla": ("deepseek_v3", {"block_size": None}, {}, False),
    "llama_tp2": ("llama", {"tensor_parallel_size": 2}, _TWO_CPUS, False),
    "llama_pp2": ("llama", {"pipeline_parallel_size": 2, "enforce_eager": False}, _TWO_CPUS, False),
}


def _model(kind: str, workdir: str) -> str:
    from bench.tiny_arch import build_tiny_arch
    from bench.tiny_model import build_tiny_llama

    name = KINDS[kind][0]
    path = os.path.join(workdir, name)
    return build_tiny_llama(path) if name == "llama" else build_tiny_arch(path, name)


def _engine(job: dict[str, Any]) -> dict[str, Any]:
    """One engine (in this process): the cold prompt, then the A/B rounds."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="TierKVConnector",
                                kv_connector_module_path="engine_adapter.vllm.connector", kv_role="kv_both",
                                kv_load_failure_policy="recompute", kv_connector_extra_config=job["connector"])
    kwargs = {"enforce_eager": True, "block_size": 32, "dtype": "bfloat16", **job["llm"]}
    if kwargs["block_size"] is None:
        del kwargs["block_size"]
    llm = LLM(model=job["model"], max_model_len=job["tokens"] + 256, seed=0, kv_transfer_config=transfer, **kwargs)
    prompt = [{"prompt_token_ids": [3 + (i * 104729) % 1000 for i in range(job["tokens"])]}]

    def ttft(skip: bool) -> tuple[float, int]:
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=skip)
        t0 = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens or 0

    cold, _ = ttft(False)
    hits, recomputes, hit_tokens, recompute_tokens = [], [], [], []
    for r in range(job["rounds"]):
        for skip in (False, True) if r % 2 == 0 else (True, False):
            seconds, cached = ttft(skip)
            (recomputes if skip else hits).append(seconds)
            (recompute_tokens if skip else hit_tokens).append(cached)
    llm.llm_engine.engine_core.shutdown()
    return {"cold_s": cold, "hit_s": hits, "recompute_s": recomputes, "hit_tokens": hit_tokens,
            "recompute_cached_tokens": recompute_tokens}


def _stored_bytes(stats_path: str) -> tuple[int, int]:
    """(new bytes stored by every worker and group, KV cache groups of one worker)."""
    total, groups = 0, 0
    for path in glob.glob(os.path.join(stats_path, "worker-*.json")):
        with open(path) as f:
            counters = json.load(f)
        total += sum(v for k, v in counters.items() if k.endswith("save_new_bytes"))
        groups = max(groups, counters.get("kv_cache_groups", 0))
    return total, groups


def _run(kind: str, model: str, workdir: str, tokens: int, rounds: int, hybrid: bool) -> dict[str, Any]:
    _, llm, env, _ = KINDS[kind]
    tag = f"{kind}-{'hma' if hybrid else 'full'}"
    stats = os.path.join(workdir, tag, "stats")
    job = {"model": model, "tokens": tokens, "rounds": rounds,
           "llm": llm if hybrid else {**llm, "disable_hybrid_kv_cache_manager": True},
           # Every hit loaded: this measures a hit against recomputing, not the load policy's choice.
           "connector": {"disk_path": os.path.join(workdir, tag, "kv"), "disk_bytes": "2GiB", "cpu_bytes": "512MiB",
                         "stats_path": stats, "load_policy": "always"}}
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "TOKENIZERS_PARALLELISM": "false", **env}
    before = set(glob.glob(_SHM))
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.vllm_kinds", "--child", json.dumps(job)], env=full_env,
                              capture_output=True, text=True, check=False)
    finally:
        for path in set(glob.glob(_SHM)) - before:  # what this engine's parallel workers left
            with contextlib.suppress(OSError):
                os.remove(path)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stored_bytes"], result["groups"] = _stored_bytes(stats)
    result["bytes_per_token"] = result["stored_bytes"] / tokens
    return result


@click.command("vllm-kinds", help=__doc__, context_settings=CONTEXT)
@click.option("--kinds", default=",".join(KINDS), show_default=True, help="comma-separated")
@click.option("--tokens", type=positive(), default=2048, show_default=True, help="prompt tokens")
@click.option("--rounds", type=positive(), default=5, show_default=True, help="A/B pairs per kind")
@click.option("--out", default=str(RESULTS_DIR / "vllm_kinds.json"), show_default=True)
@click.option("--child", default=None, hidden=True)
def command(kinds: str, tokens: int, rounds: int, out: str, child: str | None) -> int:
    if child is not None:  # one engine: JSON on the last line
        print("\n" + json.dumps(_engine(json.loads(child))), flush=True)
        os._exit(0)
    chosen = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = sorted(set(chosen) - set(KINDS))
    if unknown:
        raise click.BadParameter(f"unknown kinds {unknown}; known: {sorted(KINDS)}", param_hint="--kinds")
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-kinds-") as workdir:
        for kind in chosen:
            model = _model(kind, workdir)
            runs = {"hybrid": _run(kind, model, workdir, tokens, rounds, True)}
            if KINDS[kind][3]:
                runs["full_length"] = _run(kind, model, workdir, tokens, rounds, False)
            results[kind] = runs
            r = runs["hybrid"]
            hit, recompute = statistics.median(r["hit_s"]), statistics.median(r["recompute_s"])
            before = runs["full_length"]["bytes_per_token"] if "full_length" in runs else None
            pairs = statistics.median(b / a for a, b in zip(r["hit_s"], r["recompute_s"], strict=True))
            rows.append((kind, r["groups"], min(r["hit_tokens"]), round(r["bytes_per_token"]),
                         round(before) if before else "-", f"{before / r['bytes_per_token']:.2f}x" if before else "-",
                         round(recompute * 1e3, 1), round(hit * 1e3, 1), f"{pairs:.2f}x"))
    print_table(f"{tokens}-token prompt, {rounds} A/B rounds (medians)",
                ("kind", "groups", "hit tokens", "stored B/token", "full-length B/token", "saved",
                 "recompute TTFT ms", "kvstrata TTFT ms", "speedup (median of pairs)"), rows)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": machine(), "tokens": tokens, "rounds": rounds, "kinds": results}, f, indent=2)
    return 0


def main() -> None:
    command(standalone_mode=True)


if __name__ == "__main__":
    main()
