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
outwards (a scale up, a zero down) so no element is clipped. Decoding into a 16-bit dtype
adds its own rounding (`ROUNDING`). Runs on the tensor's device (CPU or GPU); decoding on
the CPU reads the codes through NumPy tables, with no temporary beyond one float32 copy.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np
import torch

_TINY = 2.0**-100  # a floor of scales and an offset of zeros: bfloat16 is exact relative to it
_MAGIC = 1.5 * 2.0**23
_UP = 1 + 2.0**-7  # bfloat16 rounds to nearest within 2**-8 relative: this margin rounds outwards
# Unit roundoff of a dtype the result is written in, plus float32's own arithmetic.
ROUNDING = {torch.float32: 2.0**-22, torch.float16: 2.0**-11 + 2.0**-22, torch.bfloat16: 2.0**-8 + 2.0**-22}


class Fmt(enum.Enum):
    """The code format of one group of elements."""

    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"

    @property
    def qmax(self) -> float:
        return {Fmt.INT8: 127.0, Fmt.FP8: 448.0, Fmt.INT4: 15.0}[self]

    @property
    def has_zero(self) -> bool:
        return self is Fmt.INT4

    def code_bytes(self, num_elements: int) -> int:
        return num_elements // 2 if self is Fmt.INT4 else num_elements


class Quantized(NamedTuple):
    """Codes (uint8, packed for INT4) and the groups' bfloat16 scales (and zeros for INT4)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def _round_(x: torch.Tensor) -> torch.Tensor:
    """Round `x` (float32, |x| < 2**22) to the nearest integer, ties to even, in place: adding
    and subtracting 1.5 * 2**23 leaves no fraction bits. Same result as `torch.round_`, which
    on the CPU wakes torch's thread pool for any size (a vectorized math kernel with a small
    grain) and costs milliseconds per call on a busy machine."""
    return x.add_(_MAGIC).sub_(_MAGIC)


def _round_up(v: torch.Tensor) -> torch.Tensor:
    """bfloat16 values >= `v` (float32, non-negative), at least `_TINY`."""
    return (v * _UP).clamp_(min=_TINY).to(torch.bfloat16)


def _round_down(v: torch.Tensor) -> torch.Tensor:
    """bfloat16 values <= `v` (float32)."""
    return (v - v.abs() * (2 * (_UP - 1)) - _TINY).to(torch.bfloat16)


def scales(x: torch.Tensor, dim: int, fmt: Fmt) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's scale (and zero) for `x` (float32), groups along `dim`; a group holding an
    infinite or NaN value gets a scale that is not finite."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)  # aminmax is 10x slower on CPU
    if fmt.has_zero:
        zero = _round_down(lo)
        return _round_up((hi - zero.float()) / fmt.qmax), zero
    return _round_up(torch.maximum(hi, -lo) / fmt.qmax), None


def quantize(x: torch.Tensor, dim: int, fmt: Fmt) -> Quantized:
    """Quantize `x` (float32, contiguous; overwritten) in groups along `dim` (INT4: the last
    dimension, of even length). A group with an infinite or NaN value has a `peak` that is not
    finite; its codes mean nothing."""
    scale, zero = scales(x, dim, fmt)
    if zero is not None:
        x.sub_(zero.float())
    x.div_(scale.float())
    if fmt is Fmt.FP8:
        codes = x.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    elif fmt is Fmt.INT8:
        codes = _round_(x).clamp_(-127.0, 127.0).to(torch.int8).view(torch.uint8)
    else:
        q = _round_(x).clamp_(0.0, 15.0).to(torch.uint8)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return Quantized(codes, scale, zero)


_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_INT8_TABLE = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
_NIBBLE_TABLE = np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=-1).astype(np.float32)


def codes_to_float(codes: torch.Tensor | np.ndarray, fmt: Fmt) -> torch.Tensor:
    """The codes' values (before scaling) as a new float32 tensor on the codes' device, one
    value per element (INT4: two per byte). NumPy codes go through lookup tables."""
    if isinstance(codes, np.ndarray):
        table = {Fmt.FP8: _FP8_TABLE, Fmt.INT8: _INT8_TABLE, Fmt.INT4: _NIBBLE_TABLE}[fmt]
        return torch.from_numpy(table[codes])
    if fmt is Fmt.FP8:
        return codes.view(torch.float8_e4m3fn).float()
    if fmt is Fmt.INT8:
        return codes.view(torch.int8).float()
    return torch.stack((codes & 15, codes >> 4), dim=-1).float()


def dequantize(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """`values * scale (+ zero)` in place (`values`: float32 from `codes_to_float`, shaped
    so that the scale broadcasts)."""
    values.mul_(scale)
    if zero is not None:
        values.add_(zero)
    return values


def peak(q: Quantized, fmt: Fmt) -> torch.Tensor:
    """The largest magnitude a value decoded from `q` can have (a float32 scalar; not finite if
    `q`'s input was not)."""
    top = q.scale.float() * fmt.qmax
    if q.zero is not None:
        top = top + q.zero.float().abs()
    return top.max()


def error_bound(x: torch.Tensor, dim: int, fmt: Fmt, out_dtype: torch.dtype) -> torch.Tensor:
    """The largest `|x - decoded|` each element of `x` (float32, finite) may see, decoded
    into `out_dtype`: the format's bound from the group's scale, plus the output rounding."""
    s = scales(x, dim, fmt)[0].float()
    if fmt is Fmt.FP8:
        err = torch.maximum(x.abs() / s / 16, torch.full_like(x, 2.0**-10)) * s
    else:
        err = (s / 2).expand_as(x)
    return err + (x.abs() + err) * ROUNDING[out_dtype]
