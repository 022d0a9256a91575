"""Scaled quantization of float tensors in groups: the math under the lossy codecs.

A group is the set of elements one scale spans (the elements along one dimension of the
tensor, every other index fixed). Formats:

- INT8: symmetric, `q = round(x / s)`, `s = amax / 127` (rounded up to bfloat16), so
  `|x - q s| <= s / 2`.
- FP8: `x / s` cast to float8 e4m3 (round to nearest), `s = amax / 448`: 3 mantissa bits, so
  `|x - x'| <= s * max(|x / s| / 16, 2**-10)` (relative 1/16; the last term is half the
  smallest subnormal step).
- INT4: asymmetric, `q = round((x - z) / s)` in 0..15 with `z <= min` and `z + 15 s >= max`
  (both bfloat16), so `|x - (q s + z)| <= s / 2`; two codes per byte, low nibble first.

Scales (and INT4's zeros) are bfloat16: the range of float32 at two bytes. Each is rounded
outwards (a scale up, a zero down) so no element is clipped: INT8's scale to nearest after a
margin of 2**-7, FP8's and INT4's (and INT4's zeros) to the nearest bfloat16 in that
direction. Decoding into a 16-bit dtype adds its own rounding (`ROUNDING`). Runs on the
tensor's device (CPU or GPU).

Encoded again, decoded KV finds the same scales within a few round trips and its codes stay,
so the error against the original stops growing (`reencoded_error_bound`). INT8's margin
puts a group's largest value on code 126, and `126 s`, rounded, leads back to `s`; FP8's and
INT4's largest code is the format's top one, and `448 s` (`15 s + z`), rounded, leads back
to `s` (or a step up, until the output rounding goes down). With INT8's margin, FP8 and INT4
scales grew a step on every round trip, and every decoded value with them, without end.

Speed: each op spans a whole half-block (a dozen vectorized passes per block, about 0.65 ms
to encode and 0.4 ms to decode 2 MiB of int8 on one core here), in per-thread scratch
buffers (`scratch`): a fresh half-block temporary costs a page fault per 4 KiB, more than
the pass. FP8's and INT4's scales (and zeros) are rounded on their float32 bits in place
(`_ceil_bf16`, `_floor_bf16`: three ops, where a bfloat16 round trip and its masks took
ten) and divide as they are. FP8 encoding is bound by torch's float32 -> float8 cast (about
0.55 ms per block, half the encode; an exact emulation in vectorized ops costs more), INT4
by `amin`/`amax` over groups of 32 (`aminmax` is 10x slower); `bench/codec_floor.py`
measures each step and the alternatives. The results are the bytes of the plain formulas
above (`tests/tiers/test_codec_reference.py`, `tests/tiers/test_codec_random.py`).
"""

from __future__ import annotations

import enum
import math
import struct
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch

_TINY = 2.0**-100  # a floor of scales
_UP = 1 + 2.0**-7  # INT8: bfloat16 rounds to nearest within 2**-8 relative: this margin rounds outwards
# Unit roundoff of a dtype the result is written in, plus float32's own arithmetic.
# The largest error against the original after any number of encode/decode round trips, in
# one-trip bounds (`error_bound`), per format: measured worst 2.10 (INT8, bfloat16 output),
# 1.26 (FP8), 1.97 (INT4), on Gaussian KV with outlier channels and tokens at magnitudes
# 0.01-200, every payload settled within 9 round trips (`tests/tiers/test_codec.py`); the
# factors leave a margin of 40%, 60% and 50% over those.
REENCODE_FACTOR = {"int8": 3.0, "fp8": 2.0, "int4": 3.0}
# Half the subnormal step of a dtype the result is written in: its rounding where the unit
# roundoff (relative) does not hold (FP8 decodes values down to 2**-10 scales into it).
SUBNORMAL_ROUNDING = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}
ROUNDING = {torch.float32: 2.0**-22, torch.float16: 2.0**-11 + 2.0**-22, torch.bfloat16: 2.0**-8 + 2.0**-22}


class Fmt(enum.Enum):
    """The code format of one group of elements."""

    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"

    @property
    def qmax(self) -> float:
        return _QMAX[self.value]

    @property
    def has_zero(self) -> bool:
        return self is Fmt.INT4

    def code_bytes(self, num_elements: int) -> int:
        return num_elements // 2 if self is Fmt.INT4 else num_elements


_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 15.0}


class Quantized(NamedTuple):
    """Codes (uint8, packed for INT4) and the groups' scales (and zeros for INT4): INT8's
    bfloat16; FP8's and INT4's float32 holding bfloat16 values, in per-thread scratch (valid
    until the thread's next `quantize`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def _round_up(v: torch.Tensor) -> torch.Tensor:
    """INT8's bfloat16 scales from `v` (float32, non-negative, overwritten): to nearest after
    a margin (`_UP`), at least `_TINY`; it keeps decoded KV encoded again on the same scales
    (see the module)."""
    return v.mul_(_UP).clamp_(min=_TINY).to(torch.bfloat16)


def _ceil_bf16(v: torch.Tensor) -> float | None:
    """FP8's and INT4's scales: `v` (float32, contiguous, non-negative or NaN) clamped to
    `_TINY` and rounded up to the nearest bfloat16 value in place (float32 holding bfloat16
    values; a bfloat16 value stays). Returns the largest of them, or None (`v` overwritten) if
    one is infinite or NaN. On the bits of a positive finite float, adding 0xFFFF and clearing
    the low 16 bits is the ceiling (a carry moves to the next binade, the largest float to
    infinity); checked finite first, so no NaN payload can carry into the sign bit."""
    v.clamp_(min=_TINY)
    top = float(v.max())  # NaN propagates through max
    if not math.isfinite(top):
        return None
    v.view(torch.int32).add_(0xFFFF).bitwise_and_(-0x10000)
    bits = (struct.unpack("<I", struct.pack("<f", top))[0] + 0xFFFF) & 0xFFFF0000  # the ceiling is monotonic:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])  # the largest rounded is the largest's


def _floor_bf16(v: torch.Tensor) -> torch.Tensor:
    """INT4's zeros: `v` (float32, contiguous, any sign) rounded down to the nearest bfloat16
    value in place: a negative value's magnitude goes up (0xFFFF added where the sign bit is
    set, then the low 16 bits cleared), a positive one's is cut; infinities stay. A NaN's
    result is undefined, but its group's scale is NaN and refused (`_int4_scales`)."""
    bits = v.view(torch.int32)
    negative = torch.bitwise_right_shift(bits, 31, out=scratch("sign", tuple(v.shape), torch.int32, v.device))
    bits.add_(negative, alpha=-0xFFFF).bitwise_and_(-0x10000)  # -1 where negative: + 0xFFFF there
    return v


def _int4_scales(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor | None:
    """INT4 from each group's min `lo` and max `hi` (float32, contiguous, both overwritten):
    `lo` becomes the zeros (rounded down) and the scales `(hi - zero) / 15` (rounded up) are
    returned in `hi`; None if a scale is not finite (a group with an infinite or NaN value:
    `amin`/`amax` propagate NaN)."""
    _floor_bf16(lo)
    return None if _ceil_bf16(hi.sub_(lo).div_(Fmt.INT4.qmax)) is None else hi


def _no_zero_scales(v: torch.Tensor, fmt: Fmt) -> tuple[torch.Tensor, float]:
    """INT8's or FP8's scales from `v` (each group's largest magnitude over `qmax`, float32,
    overwritten) and the largest magnitude they decode to (NaN where a scale is not finite):
    FP8's are `v` rounded up in place (`_ceil_bf16`, its peak from the largest scale), INT8's
    bfloat16 (`_round_up`)."""
    if fmt is Fmt.FP8:
        largest = _ceil_bf16(v)
        return v, math.nan if largest is None else largest * fmt.qmax
    scale = _round_up(v)
    return scale, peak(scale, None, fmt)


_BITS = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}
_scratch = threading.local()


def scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A work tensor (contents undefined) kept per thread and `slot` on the CPU and reused by
    the next call, so a block's passes run in memory already mapped (a fresh half-block
    buffer costs a page fault per 4 KiB, more than the pass itself); a new one elsewhere.
    A thread that codes blocks holds about twice a block's bytes in these, until it ends."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] | None = getattr(_scratch, "views", None)
    if views is None:
        views = _scratch.views = {}
    view = views.get((slot, shape, dtype))
    if view is None:
        nbytes = math.prod(shape) * dtype.itemsize
        held: torch.Tensor | None = getattr(_scratch, slot, None)
        if held is None or held.numel() < nbytes:  # grown: views of the old one are dropped
            held = torch.empty(nbytes, dtype=torch.uint8)
            setattr(_scratch, slot, held)
            for key in [k for k in views if k[0] == slot]:
                del views[key]
        view = views[(slot, shape, dtype)] = held[:nbytes].view(dtype).view(shape)
    return view


def _absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each group's largest magnitude (float32, keepdim), exact; not finite for a group with
    an infinite or NaN value. On the bits: clearing the sign leaves integers ordered as the
    magnitudes (NaN above infinity above every finite value), and an integer max is one fast
    pass on any strides, where a float `amax` over a short row is several times slower."""
    ints, mask = _BITS[x.element_size()]
    bits = torch.bitwise_and(x.view(ints), mask, out=scratch("ints", tuple(x.shape), ints, x.device))
    top = bits.amax(dim=dim, keepdim=True).view(x.dtype)
    return scratch("scale", tuple(top.shape), torch.float32, x.device).copy_(top)


def scales(x: torch.Tensor, dim: int, fmt: Fmt) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's scale (and zero) for `x` (a float dtype, any strides; INT4: float32),
    groups along `dim`, as new tensors (INT8: bfloat16; FP8, INT4: float32 holding bfloat16
    values); a group holding an infinite or NaN value gets a scale that is not finite (FP8,
    INT4: every scale is NaN then)."""
    if fmt.has_zero:
        lo, hi = x.amin(dim=dim, keepdim=True).float(), x.amax(dim=dim, keepdim=True).float()
        got = _int4_scales(lo, hi)
        return (hi.fill_(math.nan) if got is None else got), lo
    scale, top = _no_zero_scales(_absmax(x, dim).div_(fmt.qmax).clone(), fmt)
    return (scale.fill_(math.nan) if fmt is Fmt.FP8 and math.isnan(top) else scale), None


def peak(scale: torch.Tensor, zero: torch.Tensor | None, fmt: Fmt) -> float:
    """The largest magnitude a value decoded with these scales (and zeros) can have; not
    finite if the quantized input was not."""
    if zero is None:
        return float(scale.max()) * fmt.qmax  # in double precision: never rounds a past-limit peak down
    return float((scale.float() * fmt.qmax).add_(zero.float().abs()).max())


def quantize(x: torch.Tensor, dim: int, fmt: Fmt, codes: torch.Tensor, limit: float) -> Quantized | None:
    """Quantize `x` (a float dtype, any strides, not changed) in groups along `dim` (INT4: the
    last dimension, of even length) and write its codes into `codes` (uint8, contiguous, on
    `x`'s device, `fmt.code_bytes(x.numel())` of them). None, with `codes` unwritten, if a
    decoded value could pass `limit` (or `x` holds an infinite or NaN value).

    Every op spans the whole of `x`, so a block costs a dozen passes of vectorized kernels;
    run it under `one_thread` on the CPU. Same codes as `x.float() / scale`, rounded half to
    even (INT8, INT4) or cast (FP8), then clamped to the format (which changes nothing).
    """
    buf = scratch("float", tuple(x.shape), torch.float32, x.device).copy_(x)
    zero: torch.Tensor | None = None
    if fmt is Fmt.INT4:  # each group's min and max into scratch, then zeros and scales in place
        zero = torch.amin(buf, dim=dim, keepdim=True, out=_group_scratch("lo", buf, dim))
        got = _int4_scales(zero, torch.amax(buf, dim=dim, keepdim=True, out=_group_scratch("hi", buf, dim)))
        top = math.nan if got is None else peak(got, zero, fmt)
    else:
        got, top = _no_zero_scales(_absmax(x, dim).div_(fmt.qmax), fmt)
    if got is None or not top <= limit:  # not finite, or past the dtype once decoded
        return None
    scale = got
    # No clamp: a scale rounded up (and a zero rounded down) keeps every finite quotient in
    # [-qmax, qmax] (INT4: [0, 15]) but for float32's rounding of the quotient (at most a unit
    # in the last place above, which rounding or the FP8 cast takes back), and `peak` refused
    # the rest. FP8's and INT4's scales and zeros are float32 already (holding bfloat16 values).
    if fmt is Fmt.FP8:
        codes.view(torch.float8_e4m3fn).view(x.shape).copy_(buf.div_(scale))
        return Quantized(codes, scale, zero)
    if zero is not None:
        buf.sub_(zero).div_(scale).round_()
        _pack4(buf, codes.view(*x.shape[:-1], -1))
        return Quantized(codes, scale, zero)
    buf.div_(_float(scale)).round_()  # one dtype: a division of mixed dtypes converts a copy first
    codes.view(torch.int8).view(x.shape).copy_(buf)
    return Quantized(codes, scale, zero)


def _group_scratch(slot: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    """A float32 scratch tensor of `x`'s shape reduced along `dim` (keepdim)."""
    shape = tuple(1 if i == dim % x.dim() else n for i, n in enumerate(x.shape))
    return scratch(slot, shape, torch.float32, x.device)


def quantize_pair(pair: torch.Tensor, shapes: tuple[tuple[int, ...], tuple[int, ...]], dims: tuple[int, int],
                  fmt: Fmt, codes: torch.Tensor, limit: float) -> torch.Tensor | None:
    """`quantize` both halves of a block at once when they share a format without zeros
    (INT8, FP8): `pair` is `[2, ...]` (K then V, a float dtype, any strides), half h grouped
    as `shapes[h]` along `dims[h]`; `codes` holds both halves' codes, K's first. Returns both
    halves' scales in one flat tensor, K's first (INT8: bfloat16; FP8: float32 scratch holding
    bfloat16 values, valid until the thread's next encode), or None as `quantize` does (if
    either half's would). The same codes as `quantize` on each half, in fewer passes: the
    cast, the bits, the rounding and the codes' copy each span the whole block, and the
    scales of both halves are rounded and checked together."""
    buf = scratch("float", tuple(pair.shape), torch.float32, pair.device).copy_(pair)
    ints, mask = _BITS[pair.element_size()]
    bits = torch.bitwise_and(pair.view(ints), mask, out=scratch("ints", tuple(pair.shape), ints, pair.device))
    grouped = [tuple(1 if i == dims[h] % len(shapes[h]) else n for i, n in enumerate(shapes[h])) for h in (0, 1)]
    counts = [math.prod(g) for g in grouped]
    v = scratch("scales", (counts[0] + counts[1],), torch.float32, pair.device)
    for h, part in enumerate((v[: counts[0]], v[counts[0] :])):
        part.view(grouped[h]).copy_(bits[h].view(shapes[h]).amax(dim=dims[h], keepdim=True).view(pair.dtype))
    got, top = _no_zero_scales(v.div_(fmt.qmax), fmt)
    if not top <= limit:  # not finite, or past the dtype once decoded
        return None
    divisor = got if fmt is Fmt.FP8 else _float(got)
    for h, part in enumerate((divisor[: counts[0]], divisor[counts[0] :])):
        buf[h].view(shapes[h]).div_(part.view(grouped[h]))  # no clamp needed: see `quantize`
    if fmt is Fmt.FP8:
        codes.view(torch.float8_e4m3fn).copy_(buf.view(-1))
    else:
        codes.view(torch.int8).copy_(buf.round_().view(-1))
    return got


def _float(t: torch.Tensor) -> torch.Tensor:
    """`t` as float32 in the "scale" scratch (a fresh 128 KiB tensor is mapped anew each time)."""
    return scratch("scale", tuple(t.shape), torch.float32, t.device).copy_(t)


def _pack4(q: torch.Tensor, out: torch.Tensor) -> None:
    """Write codes 0..15 (`q`, float32 integers, contiguous, last dimension even) into `out`
    (uint8, `q`'s shape with the last dimension halved) two per byte, low nibble first: each
    pair read as one little-endian int16 `a + 256 b` gives `(w >> 4) | w`, whose low byte is
    `a + 16 b`, and the copy into uint8 keeps the low byte (integer narrowing is modulo 256):
    two integer passes, where strided nibble ops cost several times more."""
    u = scratch("pack8", tuple(q.shape), torch.int8, q.device).copy_(q)
    if sys.byteorder != "little":
        out.copy_(u[..., 0::2] | (u[..., 1::2] << 4))
        return
    w = u.view(torch.int16)
    packed = torch.bitwise_right_shift(w, 4, out=scratch("pack16", tuple(w.shape), torch.int16, w.device))
    out.copy_(packed.bitwise_or_(w))


def _widen(codes: torch.Tensor | np.ndarray, signed: bool) -> torch.Tensor:
    """`codes` (uint8) as int16 (sign-extended if `signed`) in a scratch tensor; NumPy codes (a
    read-only payload) are converted by NumPy, so torch never wraps a read-only buffer."""
    if isinstance(codes, np.ndarray):
        out = scratch("ints", codes.shape, torch.int16, torch.device("cpu"))
        np.copyto(out.numpy(), codes.view(np.int8 if signed else np.uint8), casting="unsafe")
        return out
    return codes.view(torch.int8 if signed else torch.uint8).to(torch.int16)


def dequantize(codes: torch.Tensor | np.ndarray, fmt: Fmt, scale: torch.Tensor, zero: torch.Tensor | None,
               out: torch.Tensor) -> None:
    """Write `codes * scale (+ zero)` into `out` (any float dtype and strides; its shape
    groups the values so that `scale` (float32) broadcasts; INT4: two values per code byte):
    the product rounded to float32 (then `zero` added), then to `out`'s dtype, in four or
    five passes; `scale` is overwritten. FP8 codes go through float16 bits exactly
    (`fp8 / 2**8`, subnormals too), so the scale is taken times 2**8 (exact below 2**120;
    encoded scales stay under 2**113); the two NaN codes, which encoding never writes, decode
    as +-480 times the scale."""
    buf = scratch("float", tuple(out.shape), torch.float32, out.device)
    if fmt is Fmt.INT8:
        if isinstance(codes, np.ndarray):  # NumPy casts a read-only payload straight into the buffer
            np.copyto(buf.numpy(), codes.view(np.int8).reshape(out.shape), casting="unsafe")
        else:
            buf.copy_(codes.view(torch.int8).view(out.shape))
        buf.mul_(scale)
    elif fmt is Fmt.FP8:  # e4m3 bits s.eeee.mmm -> float16 s.0eeee.mmm0000000, a factor 2**-8 off
        w = _widen(codes, signed=True)
        half = w.bitwise_left_shift_(7).bitwise_and_(-0x4001).view(torch.float16)  # sign extension: bit 14 off
        buf.copy_(half.view(out.shape)).mul_(scale.mul_(256.0))
    else:
        w = _widen(codes, signed=False)
        pairs = torch.bitwise_left_shift(w, 4, out=scratch("pack16", tuple(w.shape), torch.int16, w.device)) \
            .bitwise_or_(w).bitwise_and_(0x0F0F) if sys.byteorder == "little" else torch.stack((w & 15, w >> 4), dim=-1)
        nibbles = pairs.view(torch.uint8) if sys.byteorder == "little" else pairs
        buf.copy_(nibbles.view(out.shape)).mul_(scale)
        if zero is not None:
            buf.add_(zero)
    out.copy_(buf)


def error_bound(x: torch.Tensor, dim: int, fmt: Fmt, out_dtype: torch.dtype) -> torch.Tensor:
    """The largest `|x - decoded|` each element of `x` (float32, finite) may see, decoded
    into `out_dtype`: the format's bound from the group's scale, plus the output rounding
    (relative, and half a subnormal step where the result is that small)."""
    s = scales(x, dim, fmt)[0].float()
    if fmt is Fmt.FP8:
        err = torch.maximum(x.abs() / s / 16, torch.full_like(x, 2.0**-10)) * s
    else:
        err = (s / 2).expand_as(x)
    return err + (x.abs() + err) * ROUNDING[out_dtype] + SUBNORMAL_ROUNDING[out_dtype]


def reencoded_error_bound(x: torch.Tensor, dim: int, fmt: Fmt, out_dtype: torch.dtype) -> torch.Tensor:
    """The largest `|x - decoded|` each element of `x` (float32, finite) may see after any
    number of round trips (decoded values encoded again): `REENCODE_FACTOR` one-trip bounds."""
    return error_bound(x, dim, fmt, out_dtype).mul_(REENCODE_FACTOR[fmt.value])
