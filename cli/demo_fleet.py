"""`kvstrata demo-fleet`: N engine processes behind `kvstrata router`, against round-robin.

Each engine is its own process: the reference runner (a small random-weight Llama, the same
weights everywhere) over a store with a pool, a CPU tier and a disk tier, publishing KV
events on loopback. A multi-document workload (questions about several long documents,
interleaved) is served twice, each time by a fresh fleet: placed round-robin, then placed
where the router's `POST /lookup` (real HTTP) says the longest prefix is. Prints the share of
prompt tokens served from cache, time to first token, and whether every answer equals the
other placement's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import click
import numpy as np

from cli.args import CONTEXT, invoke
from cli.output import print_table, write_results
from cli.ports import free_port_pair
from cli.progress import tqdm

BLOCK_SIZE = 16


def _engine(conn: Connection, name: str, port: int, disk: str, doc_tokens: int) -> None:
    """One engine process: answer prompts from `conn` until None."""
    import torch

    from cli.demo import DEMO_MODEL
    from engine_adapter.runner.model import LlamaModel
    from engine_adapter.runner.runner import KVStrataLLM
    from engine_adapter.runner.weights import init_random_weights
    from kvstore import KVCacheStore, StoreConfig

    torch.set_num_threads(1)
    layout = DEMO_MODEL.kv_layout
    doc_blocks = doc_tokens // BLOCK_SIZE + 2
    config = StoreConfig(layout, block_size=BLOCK_SIZE, namespace="kvstrata-demo-fleet", pool_blocks=2 * doc_blocks,
                         pool_device="cpu", cpu_bytes=2 * doc_blocks * layout.block_bytes(BLOCK_SIZE),
                         disk_path=disk, disk_bytes=64 * doc_blocks * layout.block_bytes(BLOCK_SIZE),
                         disk_sync=False, events_endpoint=f"tcp://127.0.0.1:{port}", instance_id=name)
    model = init_random_weights(LlamaModel(DEMO_MODEL), seed=0)
    with KVCacheStore(config) as store:
        llm = KVStrataLLM(model, store)
        conn.send("ready")
        while (prompt := conn.recv()) is not None:
            out = llm.generate([prompt], 4)[0]
            conn.send({"tokens": out.token_ids, "ttft_s": out.stats.ttft_s,
                       "reused": out.stats.num_cached_tokens, "by_tier": out.stats.cached_tokens_per_tier})


class Fleet:
    """N engine processes (spawned) with fresh disks under `root`."""

    def __init__(self, n: int, root: Path, doc_tokens: int) -> None:
        ctx = mp.get_context("spawn")
        self.names = [f"engine-{i}" for i in range(n)]
        self.ports = [free_port_pair() for _ in range(n)]
        self.conns: list[Connection] = []
        self.procs = []
        for name, port in zip(self.names, self.ports):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine, args=(child, name, port, str(root / name), doc_tokens), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(300) or conn.recv() != "ready":
                raise RuntimeError("an engine process did not start")

    def ask(self, index: int, prompt: list[int]) -> dict[str, object]:
        self.conns[index].send(prompt)
        reply: dict[str, object] = self.conns[index].recv()
        return reply

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=60)


def _ask_router(url: str, prompt: list[int]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/lookup", data=json.dumps({"token_ids": prompt}).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def _lookup(url: str, prompt: list[int]) -> str:
    best: str = _ask_router(url, prompt)["best"]
    return best


def _wait_indexed(url: str, prompt: list[int], engine: str, tokens: int) -> None:
    """Until the router knows `engine` holds the first `tokens` of `prompt` (its KV events have
    arrived), at most 10 s: the next placement is then decided on what the engines hold."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        matched = _ask_router(url, prompt)["instances"].get(engine, {}).get("matched_tokens", 0)
        if matched >= tokens:
            return
        time.sleep(0.02)


def _wait_synced(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                if json.loads(resp.read())["synced"] == n:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the router did not hear from every engine")


def serve(placement: str, prompts: list[list[int]], n: int, root: Path, doc_tokens: int) -> list[dict[str, object]]:
    from router.config import RouterConfig, Subscription
    from router.thread import RouterThread

    fleet = Fleet(n, root / placement, doc_tokens)
    router = None
    try:
        if placement == "router":
            router = RouterThread(RouterConfig(subscriptions=tuple(
                Subscription(f"tcp://127.0.0.1:{p}", name, f"tcp://127.0.0.1:{p + 1}")
                for name, p in zip(fleet.names, fleet.ports))))
            _wait_synced(router.url, n)
        out = []
        for i, prompt in enumerate(tqdm(prompts, desc=f"{placement} placement", leave=False, disable=None)):
            index = fleet.names.index(_lookup(router.url, prompt)) if router is not None else i % n
            reply = fleet.ask(index, prompt)
            out.append({**reply, "engine": fleet.names[index]})
            if router is not None:  # its events have reached the router (a fixed pause was too short under load)
                _wait_indexed(router.url, prompt, fleet.names[index], doc_tokens // BLOCK_SIZE * BLOCK_SIZE)
        return out
    finally:
        if router is not None:
            router.stop()
        fleet.close()


def run(engines: int, docs: int, questions: int, doc_tokens: int, question_tokens: int) -> dict[str, object]:
    from cli.demo import DEMO_MODEL

    rng = np.random.default_rng(0)
    documents = [rng.integers(1, DEMO_MODEL.vocab_size, size=doc_tokens).tolist() for _ in range(docs)]
    order = [d for d in range(docs) for _ in range(questions)]
    rng.shuffle(order)  # questions about different documents interleave
    prompts = [documents[d] + rng.integers(1, DEMO_MODEL.vocab_size, size=question_tokens).tolist() for d in order]
    print(f"{engines} engine processes (random-weight Llama, {DEMO_MODEL.num_layers} layers), each with a pool and a "
          f"CPU tier of about 2 documents and a disk tier; {docs} documents x {questions} questions "
          f"({doc_tokens} + {question_tokens} tokens), interleaved")
    root = Path(tempfile.mkdtemp(prefix="kvstrata-demo-fleet-"))
    results: dict[str, list[dict[str, object]]] = {}
    try:
        for placement in ("round-robin", "router"):
            results[placement] = serve(placement, prompts, engines, root, doc_tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = sum(len(p) for p in prompts)
    rows, summary = [], {}
    rr_ttft = statistics.mean(float(r["ttft_s"]) for r in results["round-robin"])  # type: ignore[arg-type]
    for placement, replies in results.items():
        reused = sum(int(r["reused"]) for r in replies)  # type: ignore[call-overload]
        ttfts = [float(r["ttft_s"]) for r in replies]  # type: ignore[arg-type]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(replies, results["round-robin"]))
        summary[placement] = {"hit_rate": reused / total, "mean_ttft_ms": statistics.mean(ttfts) * 1e3,
                              "p50_ttft_ms": statistics.median(ttfts) * 1e3, "same_answers": same}
        rows.append([placement, f"{reused / total:.1%}", statistics.mean(ttfts) * 1e3, statistics.median(ttfts) * 1e3,
                     f"{rr_ttft / statistics.mean(ttfts):.2f}x", "yes" if same else "NO"])
    ceiling = len(order) - docs  # every question after a document's first can reuse its blocks
    ceiling_rate = ceiling * (doc_tokens // BLOCK_SIZE * BLOCK_SIZE) / total
    rows.append(["(ceiling: each document computed once)", f"{ceiling_rate:.1%}", "", "", "", ""])
    summary["ceiling_hit_rate"] = ceiling_rate  # type: ignore[assignment]
    print_table("kvstrata demo-fleet: placement of requests over a fleet",
                ["placement", "prompt tokens from cache", "mean TTFT ms", "p50 TTFT ms", "TTFT vs round-robin",
                 "same answers"], rows)
    return {"engines": engines, "docs": docs, "questions": questions, "doc_tokens": doc_tokens, **summary}


@click.command("demo-fleet", help=__doc__, context_settings=CONTEXT)
@click.option("--engines", type=click.IntRange(2, 16), default=3, show_default=True)
@click.option("--docs", type=click.IntRange(1, 64), default=6, show_default=True)
@click.option("--questions", type=click.IntRange(1, 64), default=4, show_default=True, help="questions per document")
@click.option("--doc-tokens", type=click.IntRange(16, 8192), default=1024, show_default=True)
@click.option("--question-tokens", type=click.IntRange(1, 256), default=24, show_default=True)
def command(engines: int, docs: int, questions: int, doc_tokens: int, question_tokens: int) -> int:
    result = run(engines, docs, questions, doc_tokens, question_tokens)
    write_results("demo_fleet", result)
    return 0 if all(result[k]["same_answers"] for k in ("round-robin", "router")) else 1  # type: ignore[index]


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata demo-fleet")
