"""A slow link where int8 pays: the remote tier behind a rate-capped link, raw against int8.

Run: `kvstrata bench codec-link [--rate-gbps 0.5] [--blocks 24] [--rounds 5]`. A real
`redis-server` sits behind a TCP proxy on loopback that forwards at most `--rate-gbps` each
way (`bench/slow_link.py`). Two stores, each with only a remote tier through that proxy, one
writing raw blocks and one `int8`, hold the same prompt (Llama-3-8B's layout: 32 layers x
8 KV heads x 128, bfloat16, 16-token blocks of 2 MiB). Rounds alternate which store reads
first; each times `retrieve` of the whole prompt into a preallocated tensor: decoded GB/s
(what the engine receives), medians and the int8/raw ratio of each round. Raw blocks come
back bit-exact and int8 ones within the codec's bound, checked every round.

Then the load policy (`load_policy="auto"`): each store's policy measured its remote tier
while reading (decoded bytes over each whole `get_into`). It loads a block when
`block_bytes / bandwidth < block_size / prefill_rate`, so a tier pays for engines prefilling
slower than its break-even rate `bandwidth x block_size / block_bytes` tokens per second.
The table gives both break-evens, and the policy's own decision for a prompt of `--blocks`
blocks at engine rates below, between and above them.
"""

from __future__ import annotations

import math
import statistics
import time

import click
import torch

from cli.args import CONTEXT, invoke, positive
from cli.output import print_table, write_results

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CODECS = ("none", "int8")


def _kv(tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn((LAYERS, 2, tokens, HEADS, HEAD_DIM), generator=g)
    x[:, 0, :, :, [10, 74, 50, 114]] *= 10  # outlier key channels, as real keys have
    return x.to(torch.bfloat16)


def _within_int8_bound(out: torch.Tensor, kv: torch.Tensor) -> bool:
    from tiers.codecs import build_codec, parse_codec

    codec = build_codec(parse_codec("int8"), (LAYERS, 2, BLOCK, HEADS, HEAD_DIM), torch.bfloat16)
    for b in range(kv.shape[2] // BLOCK):
        part = slice(b * BLOCK, (b + 1) * BLOCK)
        bound = codec.error_bound(kv[:, :, part].contiguous())  # type: ignore[attr-defined]
        if not bool(((out[:, :, part].float() - kv[:, :, part].float()).abs() <= bound).all()):
            return False
    return True


def decisions(policy_bw: dict[str, float], num_blocks: int) -> list[dict[str, object]]:
    """What `load_policy="auto"` decides for a prompt of `num_blocks` remote blocks at engine
    prefill rates below, between and above the two tiers' break-even rates."""
    from kvstore.load_policy import LoadPolicy
    from tiers.keys import TierKind

    block_bytes = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2
    even = {c: bw * BLOCK / block_bytes for c, bw in policy_bw.items()}
    lo, hi = min(even.values()), max(even.values())
    rates = [("below both", lo / 2), ("between", math.sqrt(lo * hi)), ("above both", hi * 2)]
    out = []
    for where, rate in rates:
        row: dict[str, object] = {"engine_prefill_tokens_per_s": rate, "where": where}
        for c, bw in policy_bw.items():
            policy = LoadPolicy("auto", BLOCK, block_bytes)
            policy.adopt(rate, {TierKind.REMOTE: bw})  # the store's measured bandwidth, this engine's rate
            row[f"{c}_loads_blocks"] = policy.blocks_to_load([TierKind.REMOTE] * num_blocks)
        out.append(row)
    return out


def run(rate_gbps: float, num_blocks: int, rounds: int) -> dict[str, object]:
    from bench.slow_link import SlowLink
    from cli.redis_servers import redis_server
    from kvstore import KVCacheStore, KVLayout, StoreConfig
    from tiers.keys import TierKind

    torch.set_num_threads(1)  # the decoder on one core, as a host gives a tier's reads
    tokens = list(range(num_blocks * BLOCK))
    kv = _kv(len(tokens))
    nbytes = kv.numel() * kv.element_size()
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16)
    samples: dict[str, list[float]] = {c: [] for c in CODECS}
    with redis_server() as server, SlowLink(server.port, rate_gbps * 1e9) as link:
        stores = {c: KVCacheStore(StoreConfig(layout, block_size=BLOCK, cpu_bytes=0, remote_url=link.url,
                                              remote_codec=c, remote_timeout_s=60.0, namespace=f"codec-link-{c}",
                                              load_policy="auto")) for c in CODECS}
        try:
            for c, store in stores.items():
                store.store(tokens, kv)
                assert store.flush(), f"{c}: the remote writes did not finish"
            out = torch.empty_like(kv)
            link_bytes, link_s = 0, 0.0
            for r in range(rounds + 1):  # round 0 warms connections and the policy, untimed
                for c in CODECS if r % 2 else CODECS[::-1]:
                    out.zero_()
                    before = link.bytes_forwarded[1]
                    t0 = time.perf_counter()
                    res = stores[c].retrieve(tokens, out=out)
                    seconds = time.perf_counter() - t0
                    assert res.num_tokens == len(tokens), f"{c}: {res.num_tokens} of {len(tokens)} tokens came back"
                    assert (torch.equal(out.view(torch.int16), kv.view(torch.int16)) if c == "none"
                            else _within_int8_bound(out, kv)), f"{c}: wrong KV"
                    if r:
                        samples[c].append(nbytes / seconds / 1e9)
                        if c == "none":
                            link_bytes, link_s = link_bytes + link.bytes_forwarded[1] - before, link_s + seconds
            policy_bw = {c: float(stores[c].load_policy.bandwidth(TierKind.REMOTE) or 0.0) for c in CODECS}
        finally:
            for store in stores.values():
                store.clear()
                store.close()
    med = {c: statistics.median(s) for c, s in samples.items()}
    ratios = [i / n for i, n in zip(samples["int8"], samples["none"])]
    block_bytes = nbytes // num_blocks
    even = {c: bw * BLOCK / block_bytes for c, bw in policy_bw.items()}
    print_table(f"Remote tier behind a {rate_gbps:g} GB/s link ({num_blocks} blocks of 2 MiB, {rounds} rounds): "
                "decoded GB/s delivered by retrieve",
                ["codec", "median", "min", "max", "int8/raw per round", "policy's bandwidth", "break-even tok/s"],
                [[c, f"{med[c]:.3f}", f"{min(samples[c]):.3f}", f"{max(samples[c]):.3f}",
                  " ".join(f"{x:.2f}" for x in ratios) if c == "int8" else "-", f"{policy_bw[c] / 1e9:.3f} GB/s",
                  f"{even[c]:,.0f}"] for c in CODECS])
    dec = decisions(policy_bw, num_blocks)
    print_table(f"load_policy='auto' on a {num_blocks}-block remote hit (of {num_blocks}): blocks loaded",
                ["engine prefill tok/s", "where", "raw tier", "int8 tier"],
                [[f"{d['engine_prefill_tokens_per_s']:,.0f}", d["where"], d["none_loads_blocks"],
                  d["int8_loads_blocks"]] for d in dec])
    return {"rate_gbps": rate_gbps, "blocks": num_blocks, "block_bytes": block_bytes, "rounds": rounds,
            "decoded_gbps": samples, "median_gbps": med, "int8_vs_raw_per_round": ratios,
            "int8_vs_raw_median": statistics.median(ratios),
            "link_measured_gbps_raw_reads": link_bytes / link_s / 1e9 if link_s else None,
            "policy_bandwidth_bps": policy_bw, "break_even_prefill_tokens_per_s": even, "decisions": dec}


@click.command("codec-link", help=__doc__, context_settings=CONTEXT)
@click.option("--rate-gbps", type=click.FloatRange(min=0.001, max=100.0), default=0.5, show_default=True,
              help="The link's cap, GB/s each way.")
@click.option("--blocks", "num_blocks", type=positive(), default=24, show_default=True, help="Blocks of 2 MiB.")
@click.option("--rounds", type=positive(), default=5, show_default=True)
def command(rate_gbps: float, num_blocks: int, rounds: int) -> None:
    write_results("codec_link", run(rate_gbps, num_blocks, rounds))


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata bench codec-link")


if __name__ == "__main__":
    raise SystemExit(main())
