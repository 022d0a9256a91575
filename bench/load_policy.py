"""Load or recompute: time to first token under `load_policy` auto, always and never, with the
disk tier capped to a low read bandwidth.

Run: `kvstrata bench load-policy [--disk-mbps 4]`. The reference runner (the demo's
random-weight Llama) serves one long document whose KV sits half in the CPU tier (the
prefix) and half on a disk tier capped at `--disk-mbps` (the tail), the placement eviction
produces. The question about it is timed under each policy: "always" loads the whole cached
prefix (the field's fixed rule), "never" recomputes it, "auto" loads what its measures say
beats recomputing. Trials alternate between policies (A/B/C, A/B/C, ...), each from a fresh
store built the same way; the table shows the median time to first token and the ratio to
"never" (a full recompute), measured in the same run.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import click
import numpy as np

from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results
from cli.progress import tqdm

BLOCK_SIZE = 16
MODES = ("never", "always", "auto")


def trial(mode: str, doc_tokens: int, disk_bps: int, workdir: Path) -> dict[str, object]:
    """One fresh store, the placement built by real traffic, then the timed question."""
    import torch

    from cli.demo import DEMO_MODEL
    from engine_adapter.runner.model import LlamaModel
    from engine_adapter.runner.runner import KVStrataLLM
    from engine_adapter.runner.weights import init_random_weights
    from kvstore import KVCacheStore, StoreConfig

    layout = DEMO_MODEL.kv_layout
    doc_blocks = doc_tokens // BLOCK_SIZE
    rng = np.random.default_rng(0)
    warm, doc, other = (rng.integers(1, DEMO_MODEL.vocab_size, size=doc_tokens).tolist() for _ in range(3))
    question = rng.integers(1, DEMO_MODEL.vocab_size, size=16).tolist()
    config = StoreConfig(layout, block_size=BLOCK_SIZE, namespace="bench-load-policy", pool_blocks=doc_blocks + 4,
                         pool_device="cpu", cpu_bytes=(doc_blocks // 2 + 4) * layout.block_bytes(BLOCK_SIZE),
                         disk_path=str(workdir), disk_bytes=16 * doc_blocks * layout.block_bytes(BLOCK_SIZE),
                         disk_sync=False, disk_read_bps=disk_bps, load_policy=mode)
    model = init_random_weights(LlamaModel(DEMO_MODEL), seed=0)
    with KVCacheStore(config) as store:
        llm = KVStrataLLM(model, store)
        llm.generate([warm + question], 1)  # the prefill rate is measured on these three
        llm.generate([doc + question], 1)
        llm.generate([other + question], 1)  # pushes `doc` down: prefix to the CPU tier, tail to disk
        # Calibration: a small read from disk (the policy measures the disk's bandwidth).
        block = torch.empty(layout.block_shape(BLOCK_SIZE), dtype=layout.dtype)
        store.blocks.load(store.keys(warm[: 4 * BLOCK_SIZE]), [block.clone() for _ in range(4)])
        placement = {kind.value: n for kind, n in store.blocks.lookup(store.keys(doc)).blocks_per_tier.items()}
        out = llm.generate([doc + question], 4)[0]
        return {"ttft_s": out.stats.ttft_s, "tokens": out.token_ids, "by_tier": out.stats.cached_tokens_per_tier,
                "computed": out.stats.num_prefill_tokens, "placement_blocks": placement,
                "prefill_tokens_per_s": store.load_policy.prefill_rate,
                "disk_bytes_per_s": store.load_policy.bandwidth(store.tiers[-1].kind)}


def run(doc_tokens: int, disk_mbps: float, repeats: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="kvstrata-load-policy-"))
    results: dict[str, list[dict[str, object]]] = {m: [] for m in MODES}
    try:
        order = [(r, m) for r in range(repeats) for m in MODES]  # interleaved: A/B/C, A/B/C, ...
        for r, mode in tqdm(order, desc="trials", leave=False, disable=None):
            results[mode].append(trial(mode, doc_tokens, int(disk_mbps * 1e6), root / f"{mode}-{r}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {m: statistics.median(float(t["ttft_s"]) for t in results[m]) for m in MODES}  # type: ignore[arg-type]
    reference = results["never"][0]["tokens"]
    rows = []
    for m in MODES:
        last = results[m][-1]
        rows.append([m, median[m] * 1e3, f"{median['never'] / median[m]:.2f}x",
                     ", ".join(f"{k} {v}" for k, v in last["by_tier"].items()) or "-",  # type: ignore[attr-defined]
                     last["computed"], "yes" if all(t["tokens"] == reference for t in results[m]) else "NO"])
    first = results["auto"][0]
    print(f"document {doc_tokens} tokens: cached {first['placement_blocks']} blocks of {BLOCK_SIZE}; disk capped at "
          f"{disk_mbps} MB/s; measured prefill {float(first['prefill_tokens_per_s'] or 0):,.0f} tokens/s, "  # type: ignore[arg-type]
          f"disk {float(first['disk_bytes_per_s'] or 0) / 1e6:.1f} MB/s")  # type: ignore[arg-type]
    print_table(f"Load or recompute: time to first token (median of {repeats}, interleaved)",
                ["load_policy", "TTFT ms", "speedup vs never", "reused tokens by tier", "computed", "same answer"],
                rows)
    return {"doc_tokens": doc_tokens, "disk_mbps": disk_mbps, "repeats": repeats,
            "median_ttft_s": median, "speedup_vs_never": {m: median["never"] / median[m] for m in MODES},
            "auto_vs_always": median["always"] / median["auto"], "trials": results}


@click.command("load-policy", help=__doc__, context_settings=CONTEXT)
@click.option("--doc-tokens", type=click.IntRange(64, 16384), default=2048, show_default=True)
@click.option("--disk-mbps", type=click.FloatRange(min=0.01), default=4.0, show_default=True,
              help="the disk tier's read cap, MB/s")
@click.option("--repeats", type=positive(), default=3, show_default=True)
def command(doc_tokens: int, disk_mbps: float, repeats: int) -> None:
    write_results("load_policy", run(doc_tokens, disk_mbps, repeats))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench load-policy")
