"""Long-document QA through vLLM (CPU) with and without kvstrata's connector, in one run.

Each of `--docs` documents is asked `--questions` questions, one round of questions after
another, in zigzag order (0..n-1, then n-1..0, ...). vLLM's own KV cache holds about one
document, so between rounds a document's KV is gone from vLLM and only the connector can
bring it back. Each configuration runs in its own
engine process over the same seeded workload. Prints a table and writes
`results/vllm_longdoc.json`. Needs the `vllm` extra: `bash scripts/setup_vllm.sh`, then
`.venv-vllm/bin/python -m bench.vllm_longdoc`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import click

from bench.tiny_model import TinyLlamaSpec, build_tiny_llama
from cli.args import (
    CONTEXT,
    VLLM_INSTALL,
    VLLM_PACKAGES,
    ByteSize,
    OutputFile,
    invoke,
    positive,
    require_packages,
)

BLOCK = 32
MODEL = TinyLlamaSpec(
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_positions=8192,
)


def _workload(args: SimpleNamespace) -> list[list[tuple[int, list[int]]]]:
    """Rounds of (doc index, prompt token ids): document then question, seeded."""
    import random

    rng = random.Random(args.seed)
    docs = [
        [rng.randrange(3, MODEL.vocab_size) for _ in range(args.doc_tokens)]
        for _ in range(args.docs)
    ]
    rounds = []
    for q in range(args.questions):
        order = range(args.docs) if q % 2 == 0 else reversed(range(args.docs))  # zigzag
        rounds.append(
            [
                (
                    d,
                    docs[d]
                    + [rng.randrange(3, MODEL.vocab_size) for _ in range(args.question_tokens)],
                )
                for d in order
            ]
        )
    return rounds


def _run_engine(args: SimpleNamespace, with_connector: bool, workdir: str) -> dict:
    """One engine, the whole workload; returns per-request timings and connector counters."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict = {}
    stats_path = os.path.join(workdir, "stats")
    if with_connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path="engine_adapter.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes": args.cpu_bytes,
                "disk_path": os.path.join(workdir, "kv"),
                "disk_bytes": "2GiB",
                "stats_path": stats_path,
            },
            kv_load_failure_policy="recompute",
        )
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        block_size=BLOCK,
        dtype="float32",
        seed=0,
        max_model_len=args.doc_tokens + args.question_tokens + args.max_tokens + BLOCK,
        num_gpu_blocks_override=args.vllm_blocks,
        disable_log_stats=False,
        **kwargs,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    requests = []
    t_all = time.perf_counter()
    for round_index, batch in enumerate(_workload(args)):
        for doc, prompt in batch:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
            requests.append(
                {
                    "round": round_index,
                    "doc": doc,
                    "prompt_tokens": len(prompt),
                    "cached_tokens": out.num_cached_tokens or 0,
                    "ttft_s": ttft,
                    "seconds": seconds,
                    "output": list(out.outputs[0].token_ids),
                }
            )
    total = time.perf_counter() - t_all
    counters: dict[str, int] = {}
    for path in glob.glob(os.path.join(stats_path, "*.json")):
        with open(path) as f:
            for k, v in json.load(f).items():
                counters[k] = counters.get(k, 0) + v
    return {
        "connector": with_connector,
        "total_s": total,
        "requests": requests,
        "counters": counters,
    }


def _summary(run: dict) -> dict:
    reqs = run["requests"]
    warm = [r for r in reqs if r["round"] > 0]
    prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
    c = run["counters"]
    cpu, disk = c.get("load_tokens_cpu", 0), c.get("load_tokens_disk", 0)
    cached = sum(r["cached_tokens"] for r in reqs)
    return {
        "ttft_cold_ms": 1000 * statistics.median(r["ttft_s"] for r in reqs if r["round"] == 0),
        "ttft_warm_ms": 1000 * statistics.median(r["ttft_s"] for r in warm or reqs),
        "total_s": run["total_s"],
        "share_vllm": (cached - cpu - disk) / prompt_tokens,
        "share_cpu": cpu / prompt_tokens,
        "share_disk": disk / prompt_tokens,
        "share_computed": (prompt_tokens - cached) / prompt_tokens,
    }


_PASSED = ("docs", "doc_tokens", "questions", "question_tokens", "max_tokens", "vllm_blocks", "cpu_bytes", "seed",
           "out")


@click.command("vllm", help=__doc__, context_settings=CONTEXT)
@click.option("--docs", type=positive(), default=6, show_default=True)
@click.option("--doc-tokens", type=positive(), default=2048, show_default=True)
@click.option("--questions", type=positive(), default=3, show_default=True, help="rounds; round 0 is cold")
@click.option("--question-tokens", type=positive(), default=32, show_default=True)
@click.option("--max-tokens", type=positive(), default=16, show_default=True)
@click.option("--vllm-blocks", type=positive(), default=80, show_default=True, help="vLLM's own KV cache, in blocks")
@click.option("--cpu-bytes", type=ByteSize(), default="24MiB", show_default=True,
              help="kvstrata CPU tier (the rest spills to disk)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="model dir (default: build the tiny model)")
@click.option("--out", type=OutputFile(), default="results/vllm_longdoc.json", show_default=True)
@click.option("--engine", type=click.Choice(["with", "without"]), default=None, hidden=True)
@click.option("--workdir", default=None, hidden=True)
def command(**options: Any) -> int:
    args = SimpleNamespace(**options)
    if args.engine:  # child: one configuration, JSON on the last line
        result = _run_engine(args, args.engine == "with", args.workdir)
        print("\n" + json.dumps(result), flush=True)
        os._exit(0)

    longest = args.doc_tokens + args.question_tokens + args.max_tokens + BLOCK
    if args.model is None and longest > MODEL.max_positions:
        raise click.UsageError(f"--doc-tokens {args.doc_tokens} + --question-tokens {args.question_tokens} + "
                               f"--max-tokens {args.max_tokens} is beyond the tiny model's "
                               f"{MODEL.max_positions - BLOCK} positions")
    require_packages(VLLM_PACKAGES, "it runs real vLLM and", VLLM_INSTALL)
    workdir = tempfile.mkdtemp(prefix="kvstrata-longdoc-")
    try:
        args.model = args.model or build_tiny_llama(os.path.join(workdir, "model"), MODEL)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        runs = {}
        for mode in ("without", "with"):
            cmd = [
                sys.executable,
                "-m",
                "bench.vllm_longdoc",
                *[part for name in _PASSED for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))],
                "--model",
                args.model,
                "--engine",
                mode,
                "--workdir",
                workdir,
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-5000:])
                return 1
            runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    same = [
        a["output"] == b["output"]
        for a, b in zip(runs["without"]["requests"], runs["with"]["requests"], strict=True)
    ]
    rows = {mode: _summary(run) for mode, run in runs.items()}
    header = (
        "connector",
        "median TTFT cold ms",
        "median TTFT warm ms",
        "total s",
        "vLLM cache",
        "kvstrata CPU",
        "kvstrata disk",
        "computed",
    )
    print(
        f"{args.docs} docs x {args.doc_tokens} tokens, {args.questions} question rounds, "
        f"vLLM cache {args.vllm_blocks} blocks of {BLOCK}, kvstrata CPU {args.cpu_bytes}"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for mode, r in rows.items():
        print(
            f"| {mode} | {r['ttft_cold_ms']:.1f} | {r['ttft_warm_ms']:.1f} | {r['total_s']:.2f} | "
            f"{r['share_vllm']:.1%} | {r['share_cpu']:.1%} | {r['share_disk']:.1%} | "
            f"{r['share_computed']:.1%} |"
        )
    ratio = rows["without"]["ttft_warm_ms"] / rows["with"]["ttft_warm_ms"]
    print(f"warm TTFT without / with connector: {ratio:.2f}x; identical outputs: {all(same)}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": {k: v for k, v in vars(args).items() if k not in ("engine", "workdir")},
                "summary": rows,
                "warm_ttft_ratio": ratio,
                "identical_outputs": all(same),
                "runs": runs,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench vllm")


if __name__ == "__main__":
    sys.exit(main())
