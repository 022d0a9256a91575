"""Hashing cost: kvstrata's chains against vLLM's default SHA-256-over-pickle chain.

Run: `kvstrata bench hashing [--tokens N]`. Reports ns/token and the ratio to vLLM's chain
measured in the same run. vLLM's function is imported when vLLM is installed; otherwise a
faithful re-implementation is used: SHA-256 over `pickle.dumps((parent, tuple(tokens),
extra_keys))`, seeded with the hash of "vllm-none-hash" (the block_size 16 default chain).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable

import click
import numpy as np

from bench.common import timeit
from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results
from kvstore.hashing import block_hashes


def vllm_reference_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's default prefix-cache chain (sha256 of a pickled tuple per block)."""
    prev = hashlib.sha256(b"vllm-none-hash").digest()
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        data = pickle.dumps((prev, tuple(tokens[i : i + block_size]), None), protocol=pickle.HIGHEST_PROTOCOL)
        prev = hashlib.sha256(data).digest()
        out.append(prev)
    return out


def _vllm_chain() -> tuple[str, Callable[[list[int], int], object]]:
    try:  # pragma: no cover - only with vLLM installed
        from vllm.utils.hashing import sha256 as vllm_sha256  # type: ignore[import-not-found]  # optional extra
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash  # type: ignore[import-not-found]  # ditto

        init_none_hash(vllm_sha256)

        def chain(tokens: list[int], block_size: int) -> object:
            prev = None
            for i in range(0, len(tokens) - block_size + 1, block_size):
                prev = hash_block_tokens(vllm_sha256, prev, tokens[i : i + block_size], None)
            return prev

        return "vllm (imported)", chain
    except Exception:
        return "vllm (re-implemented)", vllm_reference_chain


def run(num_tokens: int = 32768, block_sizes: tuple[int, ...] = (16, 64, 256), repeat: int = 5) -> dict[str, object]:
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 128_000, size=num_tokens, dtype=np.int64)
    tokens_list = tokens_np.tolist()
    vllm_name, vllm_chain = _vllm_chain()
    rows, records = [], []
    for bs in block_sizes:
        base = timeit(lambda bs=bs: vllm_chain(tokens_list, bs), repeat=repeat) / num_tokens * 1e9
        for algo in ("xxh3_128", "sha256"):
            for kind, toks in (("list", tokens_list), ("numpy", tokens_np)):
                ns = timeit(lambda a=algo, t=toks, bs=bs: block_hashes(t, bs, namespace="bench", algo=a), repeat=repeat)
                ns = ns / num_tokens * 1e9
                rows.append([bs, f"kvstrata {algo}", kind, ns, base, base / ns])
                records.append({"block_size": bs, "algo": algo, "input": kind, "ns_per_token": ns,
                                "baseline_ns_per_token": base, "speedup_vs_vllm": base / ns})
        rows.append([bs, vllm_name, "list", base, base, 1.0])
    print_table(f"Block hashing, {num_tokens} tokens (median of {repeat})",
                ["block", "chain", "input", "ns/token", "vllm ns/token", "x faster"], rows)
    return {"num_tokens": num_tokens, "baseline": vllm_name, "rows": records}


@click.command("hashing", help=__doc__, context_settings=CONTEXT)
@click.option("--tokens", type=positive(), default=32768, show_default=True)
@click.option("--repeat", type=positive(), default=5, show_default=True)
def command(tokens: int, repeat: int) -> None:
    write_results("hashing", run(tokens, repeat=repeat))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench hashing")
