"""The lossy codecs' fast path against the plain reference (`test_codec_reference.py`) on
generated blocks: random shapes (odd tokens and heads, keys per channel and per token),
every float dtype, opaque pages with their groups, magnitudes from subnormal to past the
dtype's limit, all-zero and constant groups, zeros of both signs, exact rounding ties,
infinite and NaN values, and sources of any strides. The payload must be the reference's,
byte for byte (or both refuse the block), and must decode as the reference decodes it.

The scale rounding on the bits (`_ceil_bf16`, `_floor_bf16`) is also checked against the
reference's rounding on every bfloat16 value and its float32 neighbours.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.tiers.test_codec_reference import _bf16, check_against_reference
from tiers.codecs import CodecKind, build_codec
from tiers.codecs.quant import _ceil_bf16, _floor_bf16

KINDS = {"int8": CodecKind.INT8, "fp8": CodecKind.FP8, "k8v4": CodecKind.K8V4}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# What a generated block holds besides Gaussian values (each drawn independently).
SPECIALS = ("zero_group", "negative_zero", "constant_group", "subnormal_group", "ties", "huge", "inf", "nan",
            "neg_inf", "tiny_scale")


def make_block(shape: tuple[int, ...], dtype: torch.dtype, seed: int, exp: int, specials: frozenset[str]
               ) -> torch.Tensor:
    """A block `[layers, 2, tokens, heads, width]` of `dtype`: Gaussian times `2**exp` with
    the `specials` written into it (positions from the seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0**exp
    x[:, 0, ..., 0] *= 1 + 40 * torch.rand(x[:, 0, ..., 0].shape, generator=g, dtype=torch.float64)  # outliers
    layers, _, tokens, heads, width = shape

    def at() -> tuple[int, int, int, int]:
        return (int(torch.randint(layers, (1,), generator=g)), int(torch.randint(2, (1,), generator=g)),
                int(torch.randint(tokens, (1,), generator=g)), int(torch.randint(heads, (1,), generator=g)))

    info = torch.finfo(dtype)
    if "zero_group" in specials:
        x[at()[:2]][..., 1] = 0.0  # a key channel over the tokens
        x[at()] = 0.0  # a token's head vector
    if "negative_zero" in specials:
        x[at()] = -0.0
    if "constant_group" in specials:
        x[at()] = -3.25
    if "subnormal_group" in specials:
        x[at()] = torch.randn(width, generator=g, dtype=torch.float64) * info.tiny / 8
    if "tiny_scale" in specials:
        x[at()] *= 2.0**-60
    if "ties" in specials:  # k + 1/2 steps of power-of-two scales, and fp8's 3-bit ties
        ties = torch.tensor([0.5, 1.5, 2.5, -0.5, 127.0, -126.5, 1.0625, 1.1875, -3.75, 448.0, 0.001953125])
        layer, half, token, head = at()
        x[layer, half, token, head, : min(width, len(ties))] = ties[:width].double()
    if "huge" in specials:
        x[at()][0] = float(info.max) * (0.5 + 0.5 * float(torch.rand(1, generator=g)))
    for name, value in (("inf", float("inf")), ("neg_inf", float("-inf")), ("nan", float("nan"))):
        if name in specials:
            x[at()][int(torch.randint(width, (1,), generator=g))] = value
    return x.to(dtype)


def strided(block: torch.Tensor, how: str) -> torch.Tensor:
    """`block`'s values in a tensor of other strides: a slice of wider heads, every other
    element of wider rows, or a permuted storage order."""
    if how == "heads":
        wide = torch.zeros((*block.shape[:3], block.shape[3] + 2, block.shape[4]), dtype=block.dtype)
        wide[:, :, :, 1:-1] = block
        return wide[:, :, :, 1:-1]
    if how == "every_other":
        wide = torch.zeros((*block.shape[:-1], block.shape[-1] * 2), dtype=block.dtype)
        wide[..., ::2] = block
        return wide[..., ::2]
    if how == "permuted":
        return block.permute(2, 0, 3, 1, 4).contiguous().permute(1, 3, 0, 2, 4)
    return block


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, tuple[int, ...], int | None, int, int, frozenset[str], str]:
    kind = draw(st.sampled_from(sorted(KINDS)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    opaque = draw(st.booleans())
    layers, tokens, heads = draw(st.integers(1, 3)), draw(st.integers(1, 18)), draw(st.integers(1, 3))
    if opaque:
        group = draw(st.sampled_from([16, 32, 64]))
        width = group * draw(st.integers(1, 3))
    else:
        group = None
        width = draw(st.sampled_from([32, 64, 96, 128] if kind == "k8v4" else [2, 6, 32, 64, 96, 128]))
    top = {"float16": 14, "bfloat16": 120, "float32": 120}[dtype]
    exp = draw(st.integers(-30, top) | st.integers(-150, top))
    specials = frozenset(draw(st.sets(st.sampled_from(SPECIALS), max_size=3)))
    layout = draw(st.sampled_from(["contiguous", "heads", "every_other", "permuted"]))
    return kind, dtype, (layers, 2, tokens, heads, width), group, draw(st.integers(0, 2**31)), exp, specials, layout


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(("fp8", "bfloat16", (2, 2, 16, 2, 64), None, 1, 0, frozenset({"ties", "zero_group"}), "permuted"))
@example(("k8v4", "float16", (1, 2, 9, 3, 96), None, 2, -20, frozenset({"subnormal_group", "negative_zero"}),
          "heads"))
@example(("k8v4", "bfloat16", (2, 2, 5, 1, 64), 32, 3, 100, frozenset({"huge", "constant_group"}), "every_other"))
@example(("fp8", "float32", (1, 2, 8, 1, 64), 64, 4, -140, frozenset({"tiny_scale"}), "contiguous"))
@example(("k8v4", "float32", (1, 2, 8, 2, 32), None, 5, 3, frozenset({"nan", "neg_inf"}), "contiguous"))
def test_generated_blocks_encode_to_the_reference_bytes(
        case: tuple[str, str, tuple[int, ...], int | None, int, int, frozenset[str], str]) -> None:
    kind, dtype_name, shape, group, seed, exp, specials, layout = case
    dtype = DTYPES[dtype_name]
    block = make_block(shape, dtype, seed, exp, specials)
    if group is None:
        check_against_reference(KINDS[kind], strided(block, layout), dtype, None)
    else:  # opaque page bytes holding `dtype`
        check_against_reference(KINDS[kind], strided(block.view(torch.uint8), layout), dtype, group)


def _every_bf16_and_neighbours() -> torch.Tensor:
    """Every bfloat16 bit pattern as float32, each with its float32 neighbours (+-1 and +-0x7FFF
    in the low bits: just past, half way and just before the next bfloat16 value)."""
    top = torch.arange(-(2**15), 2**15, dtype=torch.int32) << 16
    bits = torch.cat([top, top + 1, top - 1, top + 0x7FFF, top + 0x8000, top - 0x8000, top + 0xFFFF])
    return bits.view(torch.float32)


def test_scale_rounding_on_the_bits_equals_the_reference_rounding() -> None:
    """`_ceil_bf16` (non-negative finite scales) and `_floor_bf16` (zeros of any sign, and the
    infinities) give the reference's directed rounding on every bfloat16 value and its float32
    neighbours; `_ceil_bf16` refuses infinite and NaN scales (their blocks are stored raw)."""
    v = _every_bf16_and_neighbours()
    finite = v[torch.isfinite(v)]
    up_in = finite.abs().clamp(min=2.0**-100)
    want_up = _bf16(up_in, up=True).float()
    got_up = up_in.clone()
    assert _ceil_bf16(got_up) == float(want_up.max())  # the largest, as `peak` takes it
    assert torch.equal(got_up.view(torch.int32), want_up.view(torch.int32))
    for part in up_in.split(4099):  # the largest of each part, from its largest unrounded value
        assert _ceil_bf16(part.clone()) == float(_bf16(part, up=True).float().max())
    down_in = torch.cat([finite, torch.tensor([float("inf"), float("-inf")])])
    want_down = _bf16(down_in, up=False).float()
    assert torch.equal(_floor_bf16(down_in.clone()).view(torch.int32), want_down.view(torch.int32))
    for bad in (float("inf"), float("nan"), -float("nan")):
        assert _ceil_bf16(torch.tensor([1.0, bad, 2.0])) is None
    nan_payloads = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    assert _ceil_bf16(nan_payloads.clone()) is None  # none carries into the sign bit unseen


def test_a_block_holding_a_nan_of_any_payload_is_refused() -> None:
    """Every lossy codec refuses (stores raw) a block holding a NaN, whatever the NaN's sign and
    payload and however the dtype widens it. Before, an FP8 block whose NaN widened to float32
    with low payload bits set (float16's 0x7FFF, float32's 0x7FFFFFFF or 0xFFFFFFFF) had the
    payload carried into the sign of its bfloat16 scale: the block was stored with a scale of
    -0.0, a record every later read refused as corrupt (a lost block, counted as damage)."""
    patterns = {torch.float16: (torch.int16, [0x7E00, 0x7C01, 0x7FFF, -1, -0x200]),
                torch.bfloat16: (torch.int16, [0x7FC0, 0x7F81, 0x7FFF, -1]),
                torch.float32: (torch.int32, [0x7FC00000, 0x7F800001, 0x7FFFFFFF, -1, 0x7FFF0001])}
    for kind in KINDS.values():
        for dtype, (ints, pats) in patterns.items():
            for pat in pats:
                for where in ("one", "group", "all"):
                    x = torch.randn(2, 2, 16, 2, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
                    bits = x.view(ints)
                    if where == "one":
                        bits[0, 1, 3, 1, 5] = pat
                    elif where == "group":
                        bits[0, 0, 3, 1, :] = pat
                    else:
                        bits[...] = pat
                    assert build_codec(kind, tuple(x.shape), dtype).encode(x) is None, (kind, dtype, hex(pat), where)
