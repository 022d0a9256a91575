"""Codecs: bytes per block, encode and decode speed, and the disk and remote tiers' bandwidth in
decoded bytes, each against raw blocks in the same run.

Run: `kvstrata bench codecs [--blocks 24] [--rounds 3] [--dtype bfloat16]`. Blocks are
Llama-3-8B's shape (32 layers x 8 KV heads x 128, 16 tokens, bfloat16 or float16: 2 MiB),
Gaussian with four outlier key channels per head. Torch runs on one thread: rates are per
core. Rounds alternate the codecs (raw, zstd, int8, ...; raw, zstd, ...), each timing its
encode (into fresh payloads, kept, as a tier's write batch does: "none" is the same copy into
fresh memory) and decode (into blocks already in memory, as an engine's KV is), a `memcpy`
of the same bytes between blocks in memory (the ceiling of one pass), a disk tier's put and
warm get_into (fresh LMDB directory each),
and, where `redis-server` is installed, a remote tier's put+flush and get_into on loopback;
medians, and ratios to raw from the same rounds. Bandwidths count decoded bytes (what the
engine receives): the effective bandwidth of a tier through the codec.

It ends with what the codecs would do to the time to first token of a disk hit on the H100
(`docs/data/h100_offload.json`): loading beats recomputing where a tier's effective
bandwidth exceeds the break-even B* = KV bytes per token x prefill tokens/s. Two effective
bandwidths per codec: the H100's measured disk delivery times the compression ratio
(decoding on the GPU, whose bandwidth is hundreds of times the disk's), and the same
through this machine's CPU decode rate (decoding on the host).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch

from cli.args import CONTEXT, invoke, positive
from cli.output import machine, print_table, write_results

SHAPE = (32, 2, 16, 8, 128)
CODECS = ("none", "zstd", "int8", "fp8", "k8v4")
H100 = Path(__file__).resolve().parents[1] / "docs" / "data" / "h100_offload.json"


def blocks(n: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(SHAPE, generator=g)
        x[:, 0, :, :, [10, 74, 50, 114]] *= 10
        out.append(x.to(dtype))
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_round(name: str, srcs: list[torch.Tensor], workdir: Path, url: str | None) -> dict[str, float]:
    from tiers.codecs import CodecSpec, build_codec, parse_codec
    from tiers.disk.tier import LMDBTier
    from tiers.keys import BlockHash, BlockKey

    dsts = [torch.zeros_like(s) for s in srcs]  # mapped already, as an engine's KV is
    if name == "memcpy":
        return {"encode_s": _timed(lambda: [d.copy_(s) for d, s in zip(dsts, srcs)]), "payload_bytes": 0.0,
                "decode_s": _timed(lambda: [s.copy_(d) for d, s in zip(dsts, srcs)])}
    kind = parse_codec(name)
    dtype = srcs[0].dtype
    codec = build_codec(kind, SHAPE, dtype)
    payloads: list[bytes | bytearray] = []
    row: dict[str, float] = {"encode_s": _timed(lambda: payloads.extend(codec.encode(s) or b"" for s in srcs))}
    row["payload_bytes"] = statistics.fmean(len(p) for p in payloads)
    row["decode_s"] = _timed(lambda: [codec.decode(p, d) for p, d in zip(payloads, dsts)])
    keys = [BlockKey(BlockHash(i.to_bytes(16, "little")), b"") for i in range(len(srcs))]
    path = workdir / f"disk-{name}"
    shutil.rmtree(path, ignore_errors=True)
    disk = LMDBTier(str(path), 4 * len(srcs) * srcs[0].numel() * 2 + (64 << 20), SHAPE, dtype, sync=False,
                    verify_tokens=False, namespace=b"bench", codec=CodecSpec(kind))
    try:
        row["disk_put_s"] = _timed(lambda: disk.put(keys[::-1], srcs[::-1]))
        disk.get_into(keys, dsts)  # warm the page cache: this times the CPU side of a read
        row["disk_get_s"] = _timed(lambda: disk.get_into(keys, dsts))
    finally:
        disk.close()
    if url is not None:
        from tiers.remote.tier import RemoteTier

        remote = RemoteTier(url, SHAPE, dtype, namespace=name.encode().ljust(16, b"."), verify_tokens=False,
                            timeout_s=5.0, codec=CodecSpec(kind))
        try:
            remote.clear()
            row["remote_put_s"] = _timed(lambda: (remote.put(keys[::-1], srcs[::-1]), remote.flush()))
            got: list[int] = []
            row["remote_get_s"] = _timed(lambda: got.append(remote.get_into(keys, dsts)))
            assert got == [len(keys)], f"remote tier returned {got} of {len(keys)} blocks"
            remote.clear()
        finally:
            remote.close()
    return row


def projection(ratios: dict[str, float], decode_gbps: dict[str, float]) -> list[dict[str, object]]:
    """Speedup of a disk hit over recomputing on the H100, per context, codec and disk state."""
    data = json.loads(H100.read_text())
    kv_per_token = float(data["kv_bytes_per_token"])
    out = []
    for n, res in data["results"].items():
        b_star = kv_per_token * res["prefix_tokens_per_s"]["recompute"]
        for state in ("disk_cold", "disk_warm"):
            disk_bps = kv_per_token * res["prefix_tokens_per_s"][state]
            for name, r in ratios.items():
                gpu = disk_bps * r
                cpu = 1 / (1 / gpu + 1 / (decode_gbps[name] * 1e9)) if name != "none" else disk_bps
                out.append({"context": int(n), "disk": state, "codec": name, "b_star_gbps": b_star / 1e9,
                            "effective_gbps_gpu_decode": gpu / 1e9, "speedup_gpu_decode": gpu / b_star,
                            "effective_gbps_cpu_decode": cpu / 1e9, "speedup_cpu_decode": cpu / b_star})
    return out


def run(num_blocks: int, rounds: int, codecs: list[str], dtype: torch.dtype = torch.bfloat16) -> dict[str, object]:
    from cli.redis_servers import redis_binary, redis_server

    torch.set_num_threads(1)  # per core: the codecs hold their ops to the calling thread anyway
    srcs = blocks(num_blocks, dtype=dtype)
    raw_bytes = num_blocks * srcs[0].numel() * 2
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-codecs-"))
    timed = ["memcpy", *codecs]
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in timed}
    try:
        try:
            redis_binary()
            server_cm = redis_server()
        except (FileNotFoundError, RuntimeError):
            server_cm = None
        server = server_cm.__enter__() if server_cm is not None else None
        try:
            for _ in range(rounds):
                for name in timed:
                    samples[name].append(one_round(name, srcs, workdir, None if server is None else server.url))
        finally:
            if server_cm is not None:
                server_cm.__exit__(None, None, None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med = {c: {k: statistics.median(s[k] for s in samples[c]) for k in samples[c][0]} for c in timed}
    gbps = {c: {k.removesuffix("_s"): raw_bytes / v / 1e9 for k, v in m.items() if k.endswith("_s")} for c, m in
            med.items()}
    ratios = {c: srcs[0].numel() * 2 / med[c]["payload_bytes"] for c in codecs}
    rows = [["memcpy", "-", "-", f"{gbps['memcpy']['encode']:.2f}", f"{gbps['memcpy']['decode']:.2f}",
             "-", "-", "-", "-"]]
    for c in codecs:
        rel = {k: gbps[c][k] / gbps["none"][k] for k in gbps[c]} if "none" in gbps else {}
        rows.append([c, f"{med[c]['payload_bytes'] / 2**20:.3f}", f"{ratios[c]:.2f}x",
                     *(f"{gbps[c][k]:.2f} ({rel.get(k, 1):.2f}x)" if k in gbps[c] else "-" for k in
                       ("encode", "decode", "disk_put", "disk_get", "remote_put", "remote_get"))])
    print_table(f"Codecs on {num_blocks} blocks of {SHAPE} {dtype} (2 MiB), one thread: decoded GB/s (ratio to raw, "
                "same rounds)",
                ["codec", "MiB/block", "smaller", "encode", "decode", "disk put", "disk get (warm)", "remote put",
                 "remote get"], rows)
    proj = projection(ratios, {c: gbps[c]["decode"] for c in codecs})
    print_table("Projected disk hit vs recompute on the H100 (TTFT ratio = effective bandwidth / B*)",
                ["context", "disk", "codec", "B* GB/s", "GPU decode GB/s", "speedup", "CPU decode GB/s", "speedup"],
                [[p["context"], p["disk"], p["codec"], f"{p['b_star_gbps']:.2f}",
                  f"{p['effective_gbps_gpu_decode']:.2f}",
                  f"{p['speedup_gpu_decode']:.2f}x", f"{p['effective_gbps_cpu_decode']:.2f}",
                  f"{p['speedup_cpu_decode']:.2f}x"] for p in proj])
    return {"machine": machine(), "shape": list(SHAPE), "dtype": str(dtype), "threads": torch.get_num_threads(),
            "blocks": num_blocks, "rounds": rounds, "median": med,
            "gbps": gbps, "ratio": ratios, "projection_h100": proj, "remote": server is not None}


@click.command("codecs", help=__doc__, context_settings=CONTEXT)
@click.option("--blocks", "num_blocks", type=positive(), default=24, show_default=True, help="Blocks of 2 MiB.")
@click.option("--rounds", type=positive(), default=3, show_default=True)
@click.option("--codecs", default=",".join(CODECS), show_default=True, help="Codecs, comma-separated (raw first).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16", show_default=True)
def command(num_blocks: int, rounds: int, codecs: str, dtype: str) -> None:
    write_results("codecs" if dtype == "bfloat16" else f"codecs_{dtype}",
                  run(num_blocks, rounds, [c for c in codecs.split(",") if c], getattr(torch, dtype)))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench codecs")


if __name__ == "__main__":
    raise SystemExit(main())
