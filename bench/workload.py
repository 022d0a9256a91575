"""`kvstrata bench workload`: the field's synthetic prefix-caching workloads, cache vs no cache.

Every request is served through `KVStrataLLM` on a random-weight Llama (2 layers, hidden
256, 4 query / 2 KV heads of 64, MLP 688, vocab 4096, float32: 2 KiB of KV per token),
one request at a time: once on a store with a pool, a CPU tier and an LMDB disk tier
(prefix caching on), and once on a pool-only store with prefix caching off (the
baseline), alternating request by request so that machine load hits both alike. Prompts
are random token ids from a seeded RNG with the sharing structure of the workload. Sizes,
in 16-token blocks, from the workload's working set W (its distinct full blocks, prompts
and outputs): pool = max(W/4, the largest request), CPU tier = W/4, disk = 2W; so the
working set does not fit in the pool alone, nor in pool + CPU. Reported per workload:
token hit rate (cached prompt tokens / prompt tokens) by tier, TTFT and time per request
(the whole `generate` call) with and without the cache, and whether the generated tokens
are identical (they must be; a mismatch fails the run after the results are written).
"held" is the prefix the tiers held just before each request (`store.lookup`): where it
exceeds the hit rate, hits were lost between lookup and load (see `KVCacheManager`: making
room in the pool demotes blocks, which can push planned CPU-tier blocks down to disk, and
the load stops at the first block not found where planned).

Workloads and where their parameters come from (full size: `--size full`):

\b
* chatbot: one shared system prompt + a distinct user turn per request. vLLM
  `benchmarks/benchmark_prefix_caching.py` defaults: input 128:256 tokens
  (`--input-length-range`), `--output-len` 10 (its `--repeat-count` 100 of one prompt is a
  pure repeat, not used); system prompt 1000 as in LMCache multi-round QA; 100 requests
  (ours). Default: system 512, user 64:128, 32 requests, output 4.
* multi_round: LMCache `multi-round-qa.py` (its CI settings): 10 users x 5 rounds, shared
  system prompt 1000, per-user history 2000, answer 100. Each round appends a question
  (32 tokens, ours) and the model's answer to the user's history; users take turns
  round-robin. Default: 6 users x 4 rounds, system 256, history 256, answer 8.
* rag: a shared instruction, then top-k chunks of a corpus (Zipf(1) popularity, random
  order), then a query. No standard synthetic defaults were found; ours. Only the
  instruction and leading chunks that coincide can hit (prefix caching; no CacheBlend).
  Full: instruction 1024, 100 chunks of 512, top-5, query 64, 100 requests, output 10.
  Default: instruction 256, 24 chunks of 128, top-4, query 32, 24 requests, output 4.
* long_doc_qa: LMCache `benchmarks/long_doc_qa/long_doc_qa.py` defaults: 8 documents of
  20000 tokens, a warm-up round then `--repeat-count 2` in random order, output 100. Ours:
  a distinct 32-token question after the document (LMCache repeats the document alone).
  Default: 6 documents of 1024, question 16, output 4.
* gsp: SGLang `bench_serving.py` `--dataset-name generated-shared-prefix` defaults:
  `gsp_num_groups` 64, `gsp_prompts_per_group` 16, `gsp_system_prompt_len` 2048,
  `gsp_question_len` 128, `gsp_output_len` 256; arrival order shuffled (ours). Default:
  8 groups x 6 prompts, system 512, question 32, output 4.

Scaling for a 2-core CPU: prefill here costs ~0.1 s at 512 tokens and grows faster than
linearly (~2 s at 2048), and each decode step ~20-40 ms, so prompts are cut to <= ~1100
tokens, outputs to 4-8 tokens and request counts to 18-48; `--size full` restores the
sources' numbers (hours on this CPU), `--set WORKLOAD.PARAM=VALUE` overrides one.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple, cast

import click
import numpy as np

from cli.args import CONTEXT, Choices, Directory, invoke
from cli.output import print_table, write_results
from cli.progress import tqdm
from engine_adapter.runner.model import LlamaModel
from engine_adapter.runner.model_config import LlamaConfig
from engine_adapter.runner.runner import KVStrataLLM
from engine_adapter.runner.weights import init_random_weights
from kvstore import KVCacheStore, StoreConfig

BLOCK_SIZE = 16
TIERS = ("pool", "cpu", "disk")
_SIZES = ("default", "full", "tiny")  # the presets, `--size`
_PARAMS = {  # each workload's parameters: {name: its value in each of _SIZES}
    "chatbot": {"num_requests": (32, 100, 6), "system_len": (512, 1000, 64), "user_min": (64, 128, 16),
                "user_max": (128, 256, 32), "output_len": (4, 10, 2)},
    "multi_round": {"num_users": (6, 10, 2), "num_rounds": (4, 5, 2), "system_len": (256, 1000, 32),
                    "history_len": (256, 2000, 32), "question_len": (32, 32, 8), "output_len": (8, 100, 4)},
    "rag": {"num_requests": (24, 100, 4), "instruction_len": (256, 1024, 48), "num_chunks": (24, 100, 4),
            "chunk_len": (128, 512, 16), "top_k": (4, 5, 2), "query_len": (32, 64, 8), "output_len": (4, 10, 2)},
    "long_doc_qa": {"num_documents": (6, 8, 2), "document_len": (1024, 20000, 96), "repeat_count": (2, 2, 1),
                    "question_len": (16, 32, 8), "output_len": (4, 100, 2)},
    "gsp": {"num_groups": (8, 64, 2), "prompts_per_group": (6, 16, 2), "system_len": (512, 2048, 64),
            "question_len": (32, 128, 8), "output_len": (4, 256, 2)},
}
PRESETS = {size: {workload: {name: values[i] for name, values in params.items()}
                  for workload, params in _PARAMS.items()}
           for i, size in enumerate(_SIZES)}
WORKLOADS = tuple(_PARAMS)


class Request(NamedTuple):
    """One request: `tokens` appended to `session`'s history (None: a standalone prompt)."""

    session: int | None
    tokens: list[int]


def build(name: str, p: dict[str, int], rng: np.random.Generator, vocab: int) -> list[Request]:
    """The requests of workload `name` with parameters `p`, in arrival order."""

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab, size=n).tolist()

    if name == "chatbot":
        system = ids(p["system_len"])
        return [Request(None, system + ids(int(rng.integers(p["user_min"], p["user_max"] + 1))))
                for _ in range(p["num_requests"])]
    if name == "multi_round":
        system = ids(p["system_len"])
        starts = [Request(u, system + ids(p["history_len"]) + ids(p["question_len"])) for u in range(p["num_users"])]
        later = [Request(u, ids(p["question_len"])) for _ in range(p["num_rounds"] - 1) for u in range(p["num_users"])]
        return starts + later
    if name == "rag":
        instruction = ids(p["instruction_len"])
        chunks = [ids(p["chunk_len"]) for _ in range(p["num_chunks"])]
        popularity = 1.0 / np.arange(1, p["num_chunks"] + 1)
        out = []
        for _ in range(p["num_requests"]):
            picked = rng.choice(p["num_chunks"], size=p["top_k"], replace=False, p=popularity / popularity.sum())
            out.append(Request(None, instruction + [t for c in picked for t in chunks[c]] + ids(p["query_len"])))
        return out
    if name == "long_doc_qa":
        docs = [ids(p["document_len"]) for _ in range(p["num_documents"])]
        query = [int(i) for i in rng.permutation(np.tile(np.arange(p["num_documents"]), p["repeat_count"]))]
        return [Request(None, docs[d] + ids(p["question_len"])) for d in [*range(p["num_documents"]), *query]]
    if name == "gsp":
        groups = [ids(p["system_len"]) for _ in range(p["num_groups"])]
        reqs = [Request(None, g + ids(p["question_len"])) for g in groups for _ in range(p["prompts_per_group"])]
        return [reqs[i] for i in rng.permutation(len(reqs))]
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


class Sessions:
    """Conversation histories: a session's prompt is its history plus the new tokens."""

    def __init__(self) -> None:
        self.history: dict[int, list[int]] = {}

    def prompt(self, req: Request) -> list[int]:
        return req.tokens if req.session is None else self.history.get(req.session, []) + req.tokens

    def record(self, req: Request, prompt: list[int], output: list[int]) -> None:
        if req.session is not None:
            self.history[req.session] = prompt + output


def working_set(requests: list[Request], output_len: int, rng: np.random.Generator) -> tuple[int, int]:
    """(distinct full blocks over prompts and outputs, blocks of the largest request).

    Outputs are not known yet, so stand-in random outputs of `output_len` tokens are used.
    """
    seen: set[int] = set()
    largest = 0
    sessions = Sessions()
    for req in requests:
        prompt = sessions.prompt(req)
        output = rng.integers(1 << 20, 1 << 30, size=output_len).tolist()
        seq = prompt + output
        largest = max(largest, -(-len(seq) // BLOCK_SIZE))
        h = 0
        for i in range(len(seq) // BLOCK_SIZE):
            h = hash((h, tuple(seq[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])))
            seen.add(h)
        sessions.record(req, prompt, output)
    return len(seen), largest


def model_config(max_position: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position=max_position, dtype="float32")


def _summary(values: list[float]) -> dict[str, float]:
    q = np.percentile(values, [50, 90])
    return {"mean": statistics.fmean(values), "p50": float(q[0]), "p90": float(q[1])}


def run_workload(name: str, params: dict[str, int], model: LlamaModel, workdir: Path, seed: int,
                 bar: tqdm) -> dict[str, object]:
    """Serve workload `name` with and without the tiered cache; return its measurements."""
    rng = np.random.default_rng(seed)
    requests = build(name, params, rng, model.config.vocab_size)
    out_len = params["output_len"]
    ws_blocks, largest = working_set(requests, out_len, np.random.default_rng(seed + 1))
    layout = model.config.kv_layout
    block_bytes = layout.block_bytes(BLOCK_SIZE)
    sizes = {"working_set_blocks": ws_blocks, "pool_blocks": max(-(-ws_blocks // 4), largest + 1),
             "cpu_blocks": max(1, ws_blocks // 4), "disk_blocks": 2 * ws_blocks}
    cached_cfg = StoreConfig(
        layout, block_size=BLOCK_SIZE, namespace=f"workload-{name}", pool_blocks=sizes["pool_blocks"],
        pool_device="cpu", cpu_bytes=sizes["cpu_blocks"] * block_bytes, disk_path=str(workdir / name),
        disk_bytes=sizes["disk_blocks"] * (block_bytes + 8192) + (1 << 20), disk_sync=False, persist_on_close=False,
    )
    base_cfg = StoreConfig(layout, block_size=BLOCK_SIZE, namespace=f"base-{name}",
                           pool_blocks=sizes["pool_blocks"], pool_device="cpu", cpu_bytes=0)
    runs = {"cache": {"ttft": [], "request": []}, "baseline": {"ttft": [], "request": []}}
    per_tier = dict.fromkeys(TIERS, 0)
    prompt_tokens = findable = mismatches = 0
    bar.set_description(name)
    with KVCacheStore(cached_cfg) as cached_store, KVCacheStore(base_cfg) as base_store:
        llms = {"baseline": KVStrataLLM(model, base_store, prefix_caching=False),
                "cache": KVStrataLLM(model, cached_store, prefix_caching=True)}
        sessions = {k: Sessions() for k in llms}
        for req in requests:
            outputs = {}
            for kind, llm in llms.items():  # baseline first: it never warms the cached store
                prompt = sessions[kind].prompt(req)
                if kind == "cache":  # what the tiers hold for it now (the last token is always computed)
                    findable += min(cached_store.lookup(prompt), (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
                t0 = time.perf_counter()
                res = llm.generate([prompt], out_len)[0]
                runs[kind]["request"].append(time.perf_counter() - t0)
                runs[kind]["ttft"].append(res.stats.ttft_s)
                sessions[kind].record(req, prompt, res.token_ids)
                outputs[kind] = res.token_ids
                if kind == "cache":
                    prompt_tokens += len(prompt)
                    for tier, n in res.stats.cached_tokens_per_tier.items():
                        per_tier[tier] += n
            mismatches += outputs["cache"] != outputs["baseline"]
            bar.update(1)
        cached_store.check_integrity()
    shutil.rmtree(workdir / name, ignore_errors=True)
    cached = sum(per_tier.values())
    timing = {kind: {m: _summary(v) for m, v in r.items()} for kind, r in runs.items()}
    return {
        "params": params, "num_requests": len(requests), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens, "hit_rate_by_tier": {t: n / prompt_tokens for t, n in per_tier.items()},
        "cached_tokens_by_tier": per_tier, "findable_tokens": findable, "findable_hit_rate": findable / prompt_tokens,
        "store_blocks": sizes, "block_size": BLOCK_SIZE,
        "ttft_s": {k: v["ttft"] for k, v in timing.items()},
        "request_s": {k: v["request"] for k, v in timing.items()},
        "speedup_ttft": timing["baseline"]["ttft"]["mean"] / timing["cache"]["ttft"]["mean"],
        "speedup_request": timing["baseline"]["request"]["mean"] / timing["cache"]["request"]["mean"],
        "num_mismatched_outputs": mismatches, "outputs_identical": mismatches == 0,
    }


def resolve_params(size: str, overrides: list[str]) -> dict[str, dict[str, int]]:
    """The preset `size` with `WORKLOAD.PARAM=VALUE` overrides applied."""
    params = {w: dict(p) for w, p in PRESETS[size].items()}
    for item in overrides:
        key, _, value = item.partition("=")
        workload, _, param = key.partition(".")
        if workload not in params or param not in params[workload] or not value.lstrip("-").isdigit():
            raise ValueError(f"bad --set {item!r}: expected WORKLOAD.PARAM=INT with PARAM one of "
                             f"{sorted(params.get(workload, {}))} and WORKLOAD one of {WORKLOADS}")
        params[workload][param] = int(value)
    return params


def run(workloads: list[str], params: dict[str, dict[str, int]], seed: int,
        workdir: str | None = None) -> dict[str, object]:
    specs = {w: build(w, params[w], np.random.default_rng(seed), 2) for w in workloads}  # lengths only
    largest = max(working_set(specs[w], params[w]["output_len"], np.random.default_rng(seed))[1] for w in workloads)
    model = init_random_weights(LlamaModel(model_config(max(2048, largest * BLOCK_SIZE))), seed=seed)
    warm = KVCacheStore(StoreConfig(model.config.kv_layout, block_size=BLOCK_SIZE, pool_blocks=64,
                                    pool_device="cpu", cpu_bytes=0))
    with warm:  # first-call overheads (allocator, kernels) land on neither run
        KVStrataLLM(model, warm, prefix_caching=False).generate([list(range(300))], 2)
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-workload-", dir=workdir))
    results: dict[str, dict[str, object]] = {}
    try:
        with tqdm(total=sum(len(s) for s in specs.values()), unit="req", disable=None) as bar:
            for i, w in enumerate(workloads):
                results[w] = run_workload(w, params[w], model, tmp, seed + 100 * i, bar)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cfg = model.config
    return {"model": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                      "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                      "intermediate_size": cfg.intermediate_size, "dtype": "float32",
                      "kv_bytes_per_token": cfg.kv_layout.token_bytes},
            "seed": seed, "serving": "one request at a time; cache and baseline alternate per request",
            "workloads": results}


def report(result: dict[str, object]) -> None:
    res = cast("dict[str, dict[str, Any]]", result["workloads"])
    hits = [[w, r["num_requests"], r["prompt_tokens"], f"{r['hit_rate']:.1%}",
             *(f"{r['hit_rate_by_tier'][t]:.1%}" for t in TIERS), f"{r['findable_hit_rate']:.1%}",
             "/".join(str(r["store_blocks"][k]) for k in ("working_set_blocks", "pool_blocks", "cpu_blocks")),
             "yes" if r["outputs_identical"] else f"NO ({r['num_mismatched_outputs']})"] for w, r in res.items()]
    print_table("Token hit rate by tier (cached prompt tokens / prompt tokens); held: prefix tokens the tiers "
                "held just before each request (store.lookup), the hit rate a perfect load would reach",
                ["workload", "requests", "prompt tok", "hit rate", "pool", "CPU", "disk", "held", "W/pool/CPU blocks",
                 "same output"], hits)

    def ms(r: dict, metric: str, kind: str, stat: str) -> str:
        return f"{r[metric][kind][stat] * 1e3:.0f}"

    times = [[w, *(ms(r, "ttft_s", k, s) for k in ("cache", "baseline") for s in ("mean", "p50", "p90")),
              f"{r['speedup_ttft']:.2f}x",
              *(ms(r, "request_s", k, s) for k in ("cache", "baseline") for s in ("mean", "p50", "p90")),
              f"{r['speedup_request']:.2f}x"] for w, r in res.items()]
    print_table("TTFT and time per request (ms): tiered cache vs no-cache baseline",
                ["workload", "TTFT cache mean", "p50", "p90", "TTFT base mean", "p50", "p90", "TTFT speedup",
                 "req cache mean", "p50", "p90", "req base mean", "p50", "p90", "req speedup"], times)


@click.command("workload", help=__doc__, context_settings=CONTEXT)
@click.option("--workloads", type=Choices(WORKLOADS), default=",".join(WORKLOADS), show_default=True,
              help="workloads to run")
@click.option("--size", type=click.Choice(sorted(PRESETS)), default="default", show_default=True,
              help="parameter preset: default (scaled for 2 CPU cores), full (the sources' sizes), tiny")
@click.option("--set", "overrides", multiple=True, metavar="WORKLOAD.PARAM=VALUE",
              help="override one parameter, e.g. gsp.num_groups=16 (repeatable)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--workdir", type=Directory(), default=None, help="where the disk tiers live (default: system tmp)")
def command(workloads: list[str], size: str, overrides: tuple[str, ...], seed: int, workdir: str | None) -> None:
    try:
        params = resolve_params(size, list(overrides))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--set") from None
    result = run(workloads, params, seed, workdir)
    report(result)
    write_results("workload", {"size": size, **result})
    per_workload = cast("dict[str, dict[str, Any]]", result["workloads"])
    bad = [w for w, r in per_workload.items() if not r["outputs_identical"]]
    if bad:
        raise AssertionError(f"cached generation differs from the no-cache baseline in {bad}")


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench workload")
