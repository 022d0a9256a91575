"""`kvstrata demo-store`: a long context through every tier and back, bit-exact.

Stores one long context into a store whose CPU tier holds only part of it (the rest is
demoted to LMDB), retrieves it, reopens the store as a new process would and retrieves it
again from disk, and prints tokens per tier and GB/s for each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import click
import numpy as np
import torch

from cli.args import CONTEXT, Directory, check_memory, invoke, nonneg
from cli.demo_dir import prepare
from cli.output import print_table
from kvstore import KVCacheStore, KVLayout, RetrieveResult, StoreConfig
from tiers.keys import TierKind

T = TypeVar("T")


def run(tokens: int, layers: int, cpu_mib: int, disk_path: str, fresh: bool) -> list[list[object]]:
    layout = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    # The context's KV made in float32, its bfloat16 copy and a retrieved copy, plus the CPU tier.
    check_memory(4 * tokens * layout.token_bytes + (cpu_mib << 20), f"--tokens {tokens} with --layers {layers}")
    disk_path = str(prepare(disk_path, "demo-store", fresh=fresh))
    cfg = StoreConfig(layout, block_size=16, namespace="kvstrata-demo", cpu_bytes=cpu_mib << 20,
                      disk_path=disk_path, disk_bytes=4 * tokens * layout.token_bytes + (64 << 20))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128_000, size=tokens).tolist()
    kv = torch.randn(layout.block_shape(tokens), generator=torch.Generator().manual_seed(0)).to(layout.dtype)
    nbytes = kv.numel() * kv.element_size()
    print(f"context: {tokens} tokens, {layers} layers x 8 KV heads x 128 dims bf16 "
          f"= {nbytes / 2**20:.0f} MiB of KV; CPU tier {cpu_mib} MiB; disk tier at {disk_path}")
    rows: list[list[object]] = []

    def step(name: str, fn: Callable[[], T]) -> tuple[T, float]:
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        return res, dt

    with KVCacheStore(cfg) as store:
        cached, dt = step("store", lambda: store.store(ids, kv))
        tiers = {t.kind: t.stats().num_blocks * 16 for t in store.tiers}
        rows.append(["store", cached, tiers.get(TierKind.CPU, 0), tiers.get(TierKind.DISK, 0), nbytes / dt / 1e9, "-"])
        res, dt = step("retrieve", lambda: store.retrieve(ids))
        rows.append(_row("retrieve (CPU + disk)", res, nbytes, dt, kv))
        res, dt = step("retrieve", lambda: store.retrieve(ids))
        rows.append(_row("retrieve again", res, nbytes, dt, kv))
    with KVCacheStore(cfg) as store:  # a restart: the CPU tier is empty, LMDB persists
        res, dt = step("retrieve", lambda: store.retrieve(ids))
        rows.append(_row("retrieve after reopen", res, nbytes, dt, kv))
    print_table("kvstrata demo: one long context through the tiers",
                ["step", "tokens", "from CPU", "from disk", "GB/s", "bit-exact"], rows)
    return rows


def _row(name: str, res: RetrieveResult, nbytes: int, dt: float, kv: torch.Tensor) -> list[object]:
    exact = res.kv is not None and torch.equal(res.kv.view(torch.int16), kv[:, :, : res.num_tokens].view(torch.int16))
    per = {k: v * 16 for k, v in res.blocks_per_tier.items()}
    return [name, res.num_tokens, per.get(TierKind.CPU, 0), per.get(TierKind.DISK, 0),
            nbytes / dt / 1e9, "yes" if exact else "NO"]


@click.command("demo-store", help=__doc__, context_settings=CONTEXT)
@click.option("--tokens", type=click.IntRange(16, 1 << 22), default=16384, show_default=True,
              help="context length (>= one block of 16)")
@click.option("--layers", type=click.IntRange(1, 512), default=4, show_default=True)
@click.option("--cpu-mib", type=nonneg(), default=64, show_default=True)
@click.option("--disk-path", type=Directory(), default="kvstrata_data", show_default=True,
              help="the disk tier goes in DISK_PATH/demo-store, a folder the demo makes and marks; its next "
                   "run replaces only that folder")
@click.option("--keep", is_flag=True, help="reuse the disk tier of an earlier run")
def command(tokens: int, layers: int, cpu_mib: int, disk_path: str, keep: bool) -> int:
    rows = run(tokens, layers, cpu_mib, disk_path, fresh=not keep)
    return 0 if all(r[-1] in ("yes", "-") for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata demo-store")
