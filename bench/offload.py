"""`kvstrata offload`: long-document QA, time to first token per tier against recompute.

In the style of LMCache's long_doc_qa: D documents of N tokens, Q questions each (a
question is `--question-tokens` tokens appended to its document). The model has Llama-3-8B's
layer shape (hidden 4096, 32 query heads, 8 KV heads x 128, MLP 14336) with `--layers`
layers and random weights, so KV bytes per token per layer are the real model's; prefill
compute and KV bytes both scale linearly with the layer count, so the load-vs-recompute
ratio per layer carries over to the full 32 layers. For each N, each document's first
question is answered by recomputing (prefix caching off), then its other questions are
answered with the document's KV placed in exactly one tier: the pool, the CPU tier (pool
copies spilled down and dropped), the disk tier with the page cache dropped (cold), and the
disk tier again (warm). The pool and CPU tier are each sized below the working set of D
documents. Results: a table on stdout, JSON and a PNG plot under results/.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import click
import numpy as np
import torch

from bench.common import drop_file_cache, pyplot, save_plot
from bench.model_speed import llama3_8b_shape
from cli.args import CONTEXT, Device, Directory, IntList, invoke, positive
from cli.output import RESULTS_DIR, print_table, write_results
from cli.progress import tqdm
from engine_adapter.runner.model import LlamaModel
from engine_adapter.runner.runner import KVStrataLLM
from engine_adapter.runner.weights import init_random_weights
from kvstore import KVCacheStore, StoreConfig

BLOCK_SIZE = 16
MAX_LENGTH = 131072  # the model shape's context window (Llama-3.1: 128K)
PLACEMENTS = ("recompute", "pool", "cpu", "disk_cold", "disk_warm")


def _place(store: KVCacheStore, where: str) -> None:
    """Leave every cached block in exactly the tier `where` names (for disk_cold, the data
    file's unmapped pages are dropped from the page cache; pages the open store has mapped
    may stay, so "cold" is an upper bound on the page cache's help)."""
    pool, cpu, _disk = store.tiers
    if where in ("cpu", "disk_cold", "disk_warm"):
        pool.spill()
        pool.clear()
    if where in ("disk_cold", "disk_warm"):
        cpu.spill()
        cpu.clear()
    if where == "disk_cold":
        drop_file_cache(Path(str(store.config.disk_path)) / "data.mdb")


def run(lengths: list[int], layers: int, docs: int, questions: int, question_tokens: int, dtype: str,
        workdir: str | None = None, device: str = "cpu") -> dict[str, object]:
    config = llama3_8b_shape(layers, dtype, max_position=max(131072, max(lengths) + question_tokens + 1))
    model = init_random_weights(LlamaModel(config, device=device), seed=0, on_device=device != "cpu")
    layout = config.kv_layout
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-offload-", dir=workdir))
    results: dict[int, dict[str, object]] = {}
    try:
        for n in tqdm(lengths, desc="context lengths", disable=None):
            doc_blocks = -(-(n + question_tokens + 1) // BLOCK_SIZE)
            cfg = StoreConfig(
                layout, block_size=BLOCK_SIZE, namespace="offload", pool_blocks=int(doc_blocks * 1.5),
                pool_device=device, cpu_bytes=int(doc_blocks * 1.5) * layout.block_bytes(BLOCK_SIZE),
                disk_path=str(tmp / f"n{n}"), disk_bytes=(docs + 2) * doc_blocks * (layout.block_bytes(BLOCK_SIZE)
                                                                                  + 8192),
                disk_sync=False,
            )
            ttft: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
            served: dict[str, dict[str, int]] = {}
            same_answer = True
            # The recompute baseline gets a pool of its own (one question's worth of blocks): it
            # must not evict the store's blocks.
            base_cfg = StoreConfig(layout, block_size=BLOCK_SIZE, pool_blocks=doc_blocks + 1, pool_device=device,
                                   cpu_bytes=0)
            with KVCacheStore(cfg) as store, KVCacheStore(base_cfg) as base_store:
                llm = KVStrataLLM(model, store)
                base = KVStrataLLM(model, base_store, prefix_caching=False)
                for _ in range(docs):
                    doc = rng.integers(0, config.vocab_size, size=n).tolist()
                    qs = [doc + rng.integers(0, config.vocab_size, size=question_tokens).tolist()
                          for _ in range(questions)]
                    llm.generate([qs[0]], 1)  # the first question caches the document
                    for q in qs[1:]:
                        ref = base.generate([q], 1)[0]
                        ttft["recompute"].append(ref.stats.ttft_s)
                        base.generate([q[-2 * question_tokens :]], 1)  # untimed: settle the allocator
                        beyond_doc = store.block_hashes(q)[n // BLOCK_SIZE :]
                        for where in PLACEMENTS[1:]:
                            for tier in store.tiers:  # every row reuses exactly the document
                                tier.discard(beyond_doc)
                            _place(store, where)
                            res = llm.generate([q], 1)[0]
                            ttft[where].append(res.stats.ttft_s)
                            served[where] = res.stats.cached_tokens_per_tier
                            tier = where.removesuffix("_cold").removesuffix("_warm")
                            if served[where] != {tier: n // BLOCK_SIZE * BLOCK_SIZE}:
                                raise RuntimeError(f"{where} placement served from {served[where]} (a bug)")
                            same_answer &= res.token_ids == ref.token_ids
            kv_mib = n * layout.token_bytes / 2**20
            med = {p: statistics.median(v) for p, v in ttft.items()}
            results[n] = {"ttft_s": med, "speedup": {p: med["recompute"] / med[p] for p in PLACEMENTS},
                          "prefix_tokens_per_s": {p: n / med[p] for p in PLACEMENTS},
                          "kv_mib": kv_mib, "served": served, "same_answer_as_recompute": same_answer}
            shutil.rmtree(tmp / f"n{n}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for n, r in results.items():
        t, s = r["ttft_s"], r["speedup"]
        rows.append([n, f"{r['kv_mib']:.0f}", *(f"{t[p] * 1e3:.0f}" for p in PLACEMENTS),
                     *(f"{s[p]:.1f}x" for p in PLACEMENTS[1:])])
    print_table(
        f"Long-document QA, Llama-3-8B layer shape x {layers} layer(s), {dtype} on {device}, {docs} docs x "
        f"{questions} "
        "questions: TTFT (ms, median) and speedup over recompute",
        ["tokens", "KV MiB", *(f"{p} ms" for p in PLACEMENTS), *(f"{p} x" for p in PLACEMENTS[1:])], rows)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / "offload_ttft.png"
    if plot(png, results, f"TTFT vs context, Llama-3-8B shape x {layers} layer(s), {dtype}, {device}"):
        print(f"plot written to {png}")
    return {"layers": layers, "dtype": dtype, "device": device, "docs": docs, "questions": questions,
            "question_tokens": question_tokens, "kv_bytes_per_token": layout.token_bytes,
            "results": {str(k): v for k, v in results.items()}, "plot": str(png)}


def plot(path: Path, results: dict[int, dict[str, object]], title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    xs = sorted(results)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p, style in zip(PLACEMENTS, ("k--o", "-o", "-s", "-^", "-v")):
        ax.plot(xs, [results[x]["ttft_s"][p] * 1e3 for x in xs], style, label=p.replace("_", " "))  # type: ignore[index]  # JSON-shaped dict
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (ms)")
    save_plot(fig, ax, path, title)
    return True


@click.command("offload", help=__doc__, context_settings=CONTEXT)
@click.option("--lengths", type=IntList(BLOCK_SIZE, MAX_LENGTH), default="1024,2048,4096", show_default=True,
              help=f"comma list of context lengths, {BLOCK_SIZE} to {MAX_LENGTH}")
@click.option("--layers", type=click.IntRange(1, 128), default=1, show_default=True)
@click.option("--docs", type=positive(), default=2, show_default=True)
@click.option("--questions", type=click.IntRange(2, 1000), default=3, show_default=True,
              help="per document; the first caches it")
@click.option("--question-tokens", type=click.IntRange(1, 4096), default=32, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--workdir", type=Directory(), default=None, help="where the disk tier lives (default: system tmp)")
@click.option("--device", type=Device(), default=None, show_default="cuda when present, else cpu",
              help="device of the model and the block pool")
def command(lengths: list[int], layers: int, docs: int, questions: int, question_tokens: int, dtype: str,
            workdir: str | None, device: str | None) -> None:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    write_results("offload", run(lengths, layers, docs, questions, question_tokens, dtype, workdir, device))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata offload")
