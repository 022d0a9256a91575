"""`kvstrata demo`: questions about one long document, its KV served from every tier.

A small random-weight Llama answers questions about one document through kvstrata's
store on its embedded default (an LMDB disk tier in a local folder). Between questions,
other documents' traffic pushes the document's KV down from the pool to the CPU tier and
then to disk; finally the store is closed and reopened, as a restarted server would. For
each question the demo prints where the prefix came from, tokens reused and computed,
time to first token, the speedup over recomputing that question, and whether the answer
equals the recomputed one.
"""

from __future__ import annotations

import click
import numpy as np

from cli.args import CONTEXT, Directory, invoke
from cli.demo_dir import prepare
from cli.output import print_table
from cli.progress import tqdm
from engine_adapter.runner.model import LlamaModel
from engine_adapter.runner.model_config import LlamaConfig
from engine_adapter.runner.runner import KVStrataLLM
from engine_adapter.runner.weights import init_random_weights
from kvstore import KVCacheStore, StoreConfig

BLOCK_SIZE = 16
DEMO_MODEL = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8,
                         num_kv_heads=2, max_position=16384)


def _config(doc_tokens: int, disk_path: str) -> StoreConfig:
    layout = DEMO_MODEL.kv_layout
    doc_blocks = doc_tokens // BLOCK_SIZE + 4
    return StoreConfig(layout, block_size=BLOCK_SIZE, namespace="kvstrata-demo", pool_blocks=doc_blocks + 8,
                       pool_device="cpu", cpu_bytes=(doc_blocks + 8) * layout.block_bytes(BLOCK_SIZE),
                       disk_path=disk_path, disk_bytes=8 * doc_blocks * layout.block_bytes(BLOCK_SIZE) + (64 << 20))


class PrefillClock:
    """The forward-pass time of the last prefill on `store`: the runner reports each one to the
    store's load policy (`observe_prefill`, how the policy learns the prefill rate); this
    keeps the last report on its way there."""

    def __init__(self, store: KVCacheStore) -> None:
        self.seconds = 0.0
        self._observe = store.load_policy.observe_prefill
        store.load_policy.observe_prefill = self._record  # type: ignore[method-assign]

    def _record(self, num_tokens: int, seconds: float) -> bool:
        self.seconds = seconds
        return self._observe(num_tokens, seconds)


NOTE = """TTFT = load + compute. load: the document's KV into the pool from the tier shown, after moving
the KV already in a full pool one tier down to make room (Q3, Q4; Q5's pool is empty after the
restart). compute: the question's {q} tokens against the document, the same work in Q2-Q5; on a
busy machine (other processes on the cores PyTorch uses) it varies several-fold between questions."""


def run(doc_tokens: int, question_tokens: int, disk_path: str, fresh: bool) -> list[list[object]]:
    disk_path = str(prepare(disk_path, "demo", fresh=fresh))
    rng = np.random.default_rng(0)
    model = init_random_weights(LlamaModel(DEMO_MODEL), seed=0)
    doc, other1, other2 = (rng.integers(1, DEMO_MODEL.vocab_size, size=doc_tokens).tolist() for _ in range(3))

    def question() -> list[int]:
        tokens: list[int] = rng.integers(1, DEMO_MODEL.vocab_size, size=question_tokens).tolist()
        return tokens

    cfg = _config(doc_tokens, disk_path)
    kv_mib = doc_tokens * DEMO_MODEL.kv_layout.token_bytes / 2**20
    print(f"model: Llama-style, {DEMO_MODEL.num_layers} layers, hidden {DEMO_MODEL.hidden_size}, "
          f"{DEMO_MODEL.num_kv_heads} KV heads x {DEMO_MODEL.head_dim}, random weights, float32")
    print(f"document: {doc_tokens} tokens = {kv_mib:.0f} MiB of KV; pool and CPU tier each hold about one "
          f"document; disk tier: LMDB at {disk_path}")
    rows: list[list[object]] = []
    bar = tqdm(total=5, desc="questions", leave=False, disable=None)

    def ask(llm: KVStrataLLM, base: KVStrataLLM, clock: PrefillClock, label: str) -> None:
        prompt = doc + question()
        got = llm.generate([prompt], 8)[0]
        compute_s = clock.seconds
        ref = base.generate([prompt], 8)[0]
        st = got.stats
        tiers = ", ".join(f"{k} {v}" for k, v in st.cached_tokens_per_tier.items()) or "-"
        rows.append([label, st.source, tiers, st.num_prefill_tokens, f"{(st.ttft_s - compute_s) * 1e3:.0f}",
                     f"{compute_s * 1e3:.0f}", f"{st.ttft_s * 1e3:.0f}", f"{ref.stats.ttft_s * 1e3:.0f}",
                     f"{ref.stats.ttft_s / st.ttft_s:.1f}x", "yes" if got.token_ids == ref.token_ids else "NO"])
        bar.update(1)

    # The recompute baseline runs on a pool of its own, so it never disturbs the store shown.
    base_cfg = StoreConfig(DEMO_MODEL.kv_layout, block_size=BLOCK_SIZE, pool_blocks=cfg.pool_blocks,
                           pool_device="cpu", cpu_bytes=0)
    with KVCacheStore(cfg) as store, KVCacheStore(base_cfg) as base_store:
        llm, base, clock = KVStrataLLM(model, store), KVStrataLLM(model, base_store, prefix_caching=False), \
            PrefillClock(store)
        ask(llm, base, clock, "Q1 (first sight)")
        ask(llm, base, clock, "Q2")
        llm.generate([other1 + question()], 1)  # another document takes the pool
        ask(llm, base, clock, "Q3 (after other traffic)")
        llm.generate([other2 + question()], 1)  # two more push it to disk
        llm.generate([other1 + question()], 1)
        ask(llm, base, clock, "Q4 (after more traffic)")
    with KVCacheStore(cfg) as store, KVCacheStore(base_cfg) as base_store:  # a restarted server
        llm, base = KVStrataLLM(model, store), KVStrataLLM(model, base_store, prefix_caching=False)
        ask(llm, base, PrefillClock(store), "Q5 (after restart)")
    bar.close()
    print_table("kvstrata demo: questions about one long document",
                ["question", "prefix from", "reused tokens by tier", "computed", "load ms", "compute ms", "TTFT ms",
                 "recompute ms", "speedup", "same answer"], rows)
    print(NOTE.format(q=question_tokens))
    return rows


@click.command("demo", help=__doc__, context_settings=CONTEXT)
@click.option("--doc-tokens", type=click.IntRange(16, 16000), default=4096, show_default=True)
@click.option("--question-tokens", type=click.IntRange(1, 256), default=24, show_default=True)
@click.option("--disk-path", type=Directory(), default="kvstrata_data", show_default=True,
              help="the disk tier goes in DISK_PATH/demo, a folder the demo makes and marks; its next run "
                   "replaces only that folder")
@click.option("--keep", is_flag=True, help="reuse the disk tier of an earlier run (the first question hits disk)")
def command(doc_tokens: int, question_tokens: int, disk_path: str, keep: bool) -> int:
    rows = run(doc_tokens, question_tokens, disk_path, fresh=not keep)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata demo")
