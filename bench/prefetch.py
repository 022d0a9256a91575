"""`kvstrata bench prefetch`: what a prefetch saves the request that follows it.

A prompt's KV lies on the disk tier (the store reopened, its CPU tier empty). Each trial
times, on a fresh store each, `retrieve` straight from disk (the baseline: the request came
unannounced) and `retrieve` after a `prefetch` that was waited for (the request came after
its `POST /prefetch`), interleaved, plus the prefetch itself. The disk's files are in the
page cache after the first trial, so the gain shown is the disk tier's own cost (LMDB index,
checksums, copies), not the device's: on a cold device the gap is wider.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import click
import torch

from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results
from kvstore import KVCacheStore, KVLayout, StoreConfig
from tiers.keys import TierKind


def run(num_blocks: int, trials: int, block_size: int) -> dict[str, object]:
    """Time the trials; the medians and minima in ms, and the ratio of the medians."""
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    tokens = list(range(num_blocks * block_size))
    kv = torch.randn(layout.num_layers, 2, len(tokens), layout.num_kv_heads, layout.head_dim).to(layout.dtype)
    times: dict[str, list[float]] = {"from_disk": [], "after_prefetch": [], "prefetch": []}
    with tempfile.TemporaryDirectory() as path:
        config = StoreConfig(layout, block_size=block_size, cpu_bytes=2 * num_blocks * layout.block_bytes(block_size),
                             disk_path=path, disk_bytes=4 * num_blocks * layout.block_bytes(block_size) + (64 << 20),
                             disk_sync=False)
        with KVCacheStore(config) as store:
            store.store(tokens, kv)
        for _ in range(trials):
            with KVCacheStore(config) as store:  # reopened: every block on disk only
                t0 = time.perf_counter()
                got = store.retrieve(tokens)
                times["from_disk"].append(time.perf_counter() - t0)
                assert got.num_tokens == len(tokens)
            with KVCacheStore(config) as store:
                t0 = time.perf_counter()
                result = store.prefetch(tokens).result(timeout=120)
                times["prefetch"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = store.retrieve(tokens)
                times["after_prefetch"].append(time.perf_counter() - t0)
                assert result.num_promoted == num_blocks and got.blocks_per_tier == {TierKind.CPU: num_blocks}
    out: dict[str, object] = {k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3}
                              for k, v in times.items()}
    out["speedup"] = statistics.median(times["from_disk"]) / statistics.median(times["after_prefetch"])
    out.update(num_blocks=num_blocks, block_bytes=layout.block_bytes(block_size), trials=trials)
    return out


@click.command("prefetch", help=__doc__, context_settings=CONTEXT)
@click.option("--blocks", type=positive(), default=64, show_default=True, help="blocks of the prompt")
@click.option("--trials", type=positive(), default=8, show_default=True)
@click.option("--block-size", type=positive(), default=16, show_default=True, help="tokens per block")
def command(blocks: int, trials: int, block_size: int) -> None:
    res = run(blocks, trials, block_size)
    rows = [[name, f"{res[name]['median_ms']:.1f}", f"{res[name]['min_ms']:.1f}"]  # type: ignore[index]
            for name in ("from_disk", "after_prefetch", "prefetch")]
    print_table(f"retrieve of {blocks} blocks of {int(res['block_bytes']) >> 10} KiB ({trials} trials; "  # type: ignore[call-overload]
                f"median from disk / after prefetch: {res['speedup']:.2f}x)", ["call", "median ms", "min ms"], rows)
    write_results("prefetch", res)


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench prefetch")
