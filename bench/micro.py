"""`kvstrata bench micro`: every micro figure next to its in-run baseline.

Runs, in one process: hashing ns/token against vLLM's default chain (`bench.hashing`);
lookup cost per block for a 32K-token prompt at 0% and 100% hit, in each tier, against the
cost of hashing that prompt; store/retrieve GB/s of the pool, CPU and disk tiers against
`numpy.copyto` and raw file I/O (`bench.tiers`); pool<->CPU transfers against a plain
`copy_` (`bench.transfer`, GPU<->pinned CPU on a CUDA machine).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable

import click
import numpy as np
import torch

from bench import hashing, tiers, transfer
from cli.args import CONTEXT, Choices, Directory, invoke, positive
from cli.output import print_table, write_results
from kvstore import KVCacheStore, KVLayout, StoreConfig
from kvstore.hashing import block_hashes


def lookup_cost(num_tokens: int = 32768, block_size: int = 16, repeat: int = 20) -> dict[str, dict[str, float]]:
    """ns per block of `lookup` at 0% and 100% hit with the prefix in each tier."""
    layout = KVLayout(1, 1, 8, torch.float16)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, size=num_tokens).tolist()
    miss = rng.integers(0, 128_000, size=num_tokens).tolist()
    nblocks = num_tokens // block_size
    kv = torch.zeros(layout.block_shape(num_tokens), dtype=layout.dtype)
    bb = layout.block_bytes(block_size)
    tmp = tempfile.mkdtemp(prefix="kvstrata-micro-")
    configs = {
        "pool": StoreConfig(layout, block_size=block_size, pool_blocks=nblocks + 1, pool_device="cpu", cpu_bytes=0),
        "cpu": StoreConfig(layout, block_size=block_size, cpu_bytes=(nblocks + 1) * bb),
        "disk": StoreConfig(layout, block_size=block_size, cpu_bytes=0, disk_path=tmp, disk_bytes=256 << 20,
                            disk_sync=False),
    }

    def per_block(fn: Callable[[], object]) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat / nblocks * 1e9

    out: dict[str, dict[str, float]] = {}
    hash_ns = per_block(lambda: block_hashes(tokens, block_size, namespace="x"))
    try:
        for name, cfg in configs.items():
            with KVCacheStore(cfg) as store:
                store.store(tokens, kv)
                assert store.lookup(tokens) == num_tokens
                out[name] = {"hit_100_ns_per_block": per_block(lambda s=store: s.lookup(tokens)),
                             "hit_0_ns_per_block": per_block(lambda s=store: s.lookup(miss)),
                             "hash_only_ns_per_block": hash_ns}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [[name, r["hit_0_ns_per_block"], r["hit_100_ns_per_block"], r["hash_only_ns_per_block"],
             r["hit_100_ns_per_block"] / r["hash_only_ns_per_block"]] for name, r in out.items()]
    print_table(f"lookup() of a {num_tokens}-token prompt ({nblocks} blocks of {block_size}), ns per block",
                ["prefix in", "0% hit", "100% hit", "hashing alone", "100% hit / hashing"], rows)
    return out


@click.command("micro", help=__doc__, context_settings=CONTEXT)
@click.option("--mib", type=positive(), default=64, show_default=True,
              help="MiB of KV per block size for the bandwidth parts")
@click.option("--sizes", type=Choices(list(tiers.SIZES), str.upper), default=",".join(tiers.SIZES), show_default=True,
              help="block sizes to measure")
@click.option("--repeat", type=positive(), default=3, show_default=True)
@click.option("--workdir", type=Directory(), default=None, help="directory on the disk to measure")
def command(mib: int, sizes: list[str], repeat: int, workdir: str | None) -> None:
    result = {
        "hashing": hashing.run(repeat=repeat),
        "lookup": lookup_cost(),
        "tiers": tiers.run(mib, sizes, repeat, workdir),
        "transfer": transfer.run(mib, sizes, repeat),
    }
    write_results("micro", result)


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench micro")
