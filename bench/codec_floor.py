"""What `fp8` and `k8v4` encoding cost, step by step, against what torch and NumPy can do.

One process, torch on one thread, one Llama-3-8B block (2 MiB of bfloat16: a million
elements, each half 512K). Every variant is timed in turn, round after round (so a loaded
machine's noise falls on all alike), each run twice and the second timed (its data warm, as
the step before leaves it in an encode), and the best round of each is kept (µs):

- the codecs' whole encode, and each step of it alone, on the same block;
- the ideas for a faster encode, each against the step it would replace: one `aminmax` over
  the groups of 32 for INT4's two reductions, `abs().amax` for FP8's bits `amax`, a direct
  bfloat16 -> float8 cast, an exact emulation of torch's float32 -> float8 cast in
  vectorized ops, the divide-and-cast chain cache-blocked in 256 KiB chunks, NumPy's
  reductions;
- a `memcpy` of the block's bytes (the ceiling of one pass) in the same rounds.

    python -m bench.codec_floor [--rounds 30] [--out docs/data/codec_encode_floor.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tiers.codecs import CodecKind, build_codec

SHAPE = (32, 2, 16, 8, 128)


def variants() -> dict[str, Callable[[], object]]:
    """The timed variants by name, over one block (built here)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g)
    x[:, 0, :, :, [10, 74, 50, 114]] *= 10
    block = x.to(torch.bfloat16)
    other = torch.empty_like(block)
    fp8, k8v4 = (build_codec(k, SHAPE, torch.bfloat16) for k in (CodecKind.FP8, CodecKind.K8V4))
    pair = block.transpose(0, 1)
    f = torch.empty(pair.shape)
    bits = torch.empty(pair.shape, dtype=torch.int16)
    codes = torch.empty(f.numel(), dtype=torch.uint8)
    keys, values = (32, 16, 8, 128), (32, 16, 8, 1, 128)
    k_scale = torch.rand(32, 1, 8, 128) + 0.5
    v_scale = torch.rand(32, 16, 8, 1, 1) + 0.5
    v4 = f[1].view(32, 16, 8, 4, 32)  # INT4's groups of 32 (values, float32)
    vb4 = block[:, 1].reshape(32, 16, 8, 4, 32)
    u8 = torch.empty(v4.shape, dtype=torch.int8)
    p16 = torch.empty((32, 16, 8, 4, 16), dtype=torch.int16)
    packed = torch.empty(p16.shape, dtype=torch.uint8)
    f.copy_(pair)
    y = f.view(-1).clone().div_(64.0)  # quotients in FP8's range
    m = torch.empty(y.shape, dtype=torch.int32)
    z, h = torch.empty(y.shape), torch.empty(y.shape, dtype=torch.float16)
    low, sign = torch.empty(y.shape, dtype=torch.uint8), torch.empty(y.shape, dtype=torch.uint8)
    v4n = v4.numpy()
    q4 = torch.randint(0, 16, v4.shape, generator=g).float()  # 4-bit codes before packing

    def emulated_cast() -> None:
        """torch's float32 -> float8 e4m3 rounding, exactly, in vectorized ops: the round to 3
        mantissa bits (subnormals to 2**-9) by adding and taking back 1.5 * 2**(e + 20), then
        the exact float16 of the value / 256, whose bits are the code's shifted by 7."""
        torch.bitwise_and(y.view(torch.int32), 0x7F800000, out=m)
        m.clamp_(min=121 << 23).add_((20 << 23) | 0x400000)
        torch.add(y, m.view(torch.float32), out=z).sub_(m.view(torch.float32)).mul_(2.0**-8)
        h.copy_(z)
        torch.bitwise_right_shift(h.view(torch.int16), 7, out=low)
        torch.bitwise_right_shift(y.view(torch.int32), 24, out=sign).bitwise_and_(0x80)  # the sign of y (zeros too)
        low.bitwise_or_(sign)

    def chain(parts: int) -> None:
        """FP8's copy, division and cast over the block, in `parts` chunks of layers."""
        step, layer, half = 32 // parts, 16 * 8 * 128, f[0].numel()
        for i in range(0, 32, step):
            fk, fv = f[0, i : i + step], f[1, i : i + step]
            fk.copy_(pair[0, i : i + step]).div_(k_scale[i : i + step])
            fv.copy_(pair[1, i : i + step]).view(step, 16, 8, 1, 128).div_(v_scale[i : i + step])
            for h, part in ((0, fk), (1, fv)):  # K's codes first, then V's, as the payload
                at = h * half + i * layer
                codes[at : at + part.numel()].view(torch.float8_e4m3fn).copy_(part.reshape(-1))

    return {
        "memcpy 2 MiB": lambda: other.copy_(block),
        "fp8 encode": lambda: fp8.encode(block),
        "k8v4 encode": lambda: k8v4.encode(block),
        "step: bfloat16 -> float32 copy (block)": lambda: f.copy_(pair),
        "step: sign-cleared bits (block)": lambda: torch.bitwise_and(pair.view(torch.int16), 0x7FFF, out=bits),
        "step: bits amax, keys and values": lambda: (bits[0].amax(1, keepdim=True),
                                                     bits[1].view(values).amax(-1, keepdim=True)),
        "step: divide by the scales (block)": lambda: (f[0].view(keys).div_(k_scale), f[1].view(values).div_(v_scale)),
        "step: float32 -> float8 cast (block)": lambda: codes.view(torch.float8_e4m3fn).copy_(f.view(-1)),
        "step: amin + amax, groups of 32 (half)": lambda: (v4.amin(-1, keepdim=True), v4.amax(-1, keepdim=True)),
        "step: round (half)": lambda: f[1].round_(),
        "step: subtract the zeros (half)": lambda: f[1].view(values).sub_(v_scale),
        "step: pack 4-bit codes (half)": lambda: (u8.copy_(q4), packed.copy_(
            torch.bitwise_right_shift(u8.view(torch.int16), 4, out=p16).bitwise_or_(u8.view(torch.int16)))),
        "idea: aminmax, groups of 32 (half)": lambda: torch.aminmax(v4, dim=-1, keepdim=True),
        "idea: amin + amax on bfloat16, groups of 32 (half)": lambda: (vb4.amin(-1, keepdim=True),
                                                                      vb4.amax(-1, keepdim=True)),
        "idea: NumPy min + max, groups of 32 (half)": lambda: (v4n.min(-1), v4n.max(-1)),
        "idea: abs().amax on float32, values (half)": lambda: f[1].view(values).abs().amax(-1, keepdim=True),
        "idea: bfloat16 -> float8 cast directly (block)": lambda: codes.view(torch.float8_e4m3fn).copy_(
            pair.reshape(-1)),
        "idea: exact emulation of the float8 cast (block)": emulated_cast,
        "idea: copy, divide, cast; whole block": lambda: chain(1),
        "idea: copy, divide, cast; 8 chunks of 256 KiB": lambda: chain(8),
    }


def check_emulation() -> bool:
    """Whether `emulated_cast`'s rounding equals torch's cast on a sample of quotients."""
    g = torch.Generator().manual_seed(1)
    y = torch.cat([torch.randn(1 << 20, generator=g) * s for s in (100.0, 1.0, 1e-2, 1e-4)]).clamp(-448, 448)
    want = y.to(torch.float8_e4m3fn).view(torch.uint8)
    m = torch.bitwise_and(y.view(torch.int32), 0x7F800000).clamp_(min=121 << 23).add_((20 << 23) | 0x400000)
    z = (y + m.view(torch.float32) - m.view(torch.float32)) * 2.0**-8
    hb = z.to(torch.float16).view(torch.int16)
    got = (hb >> 7).to(torch.uint8) | ((y.view(torch.int32) >> 24).to(torch.uint8) & 0x80)
    return bool(torch.equal(got, want))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codec_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here as well")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = variants()
    best = {name: float("inf") for name in runs}
    load = [os.getloadavg()[0]]
    for fn in runs.values():
        fn()
    for _ in range(ns.rounds):
        for name, fn in runs.items():
            fn()  # warm: its data in cache, as in the encode where the step before left it
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        load.append(os.getloadavg()[0])
    us = {name: round(t * 1e6, 1) for name, t in best.items()}
    for name, value in us.items():
        print(f"{value:9.1f} us  {name}")
    exact = check_emulation()
    print(f"emulated cast equals torch's on 4M sampled quotients: {exact}")
    print(f"load average (1 min): {min(load):.1f}-{max(load):.1f}")
    if ns.out is not None:
        ns.out.write_text(json.dumps({"how": f"one process, torch on one thread, one 2 MiB bfloat16 block; best of "
                                             f"{ns.rounds} rounds, variants in turn, each run twice "
                                             "and the second timed", "us": us,
                                      "emulation_equal_on_sample": exact,
                                      "load_average_1min": [min(load), max(load)]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
