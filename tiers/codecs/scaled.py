"""The lossy codecs: each half of a block (K, V) quantized in groups with bfloat16 scales.

A structured block `[num_layers, 2, block_size, num_kv_heads, head_dim]` of a float dtype:

- keys: one scale per layer, head and channel over the block's tokens (keys have outlier
  channels; a channel's scale keeps them from swamping the others), or per token and head
  like values when the block has fewer than `MIN_CHANNEL_TOKENS` tokens;
- values: one scale per layer, token and head (INT4: per 32 channels of a head).

An opaque block (uint8, an engine's page bytes; `element_dtype` says what they hold) is
viewed as that dtype and cut into runs of `group` consecutive elements per scale, in each
half: layout-agnostic, and exact about which bytes a scale covers whatever the engine's
packing. With `group` a multiple of the head size, a run is one token's head vectors.

Payload = each half's scales (and zeros), then each half's codes; its size is fixed by the
shape. `error_bound` states the largest error of each element after one round trip,
`reencoded_error_bound` after any number of them (`tiers/codecs/quant.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tiers.codecs.base import Codec, CodecConfig, CodecKind, register_codec
from tiers.codecs.quant import (
    ROUNDING,
    Fmt,
    dequantize,
    error_bound,
    quantize,
    quantize_pair,
    reencoded_error_bound,
    scratch,
)
from tiers.codecs.threads import one_thread
from tiers.errors import ConfigError, CorruptRecordError

MIN_CHANNEL_TOKENS = 8  # below this many tokens a per-channel key scale costs more than it saves
INT4_GROUP = 32
DEFAULT_GROUP = 64  # elements per scale of an opaque block, unless the config says
FORMATS = {CodecKind.INT8: (Fmt.INT8, Fmt.INT8), CodecKind.FP8: (Fmt.FP8, Fmt.FP8),
           CodecKind.K8V4: (Fmt.INT8, Fmt.INT4)}


@dataclass(frozen=True)
class HalfPlan:
    """How one half (K or V) of a block is quantized: its view for grouping and the
    dimension each scale spans (sizes derived once: a block's encode reads them often)."""

    fmt: Fmt
    shape: tuple[int, ...]
    dim: int
    num_elements: int = field(init=False)
    scale_shape: tuple[int, ...] = field(init=False)
    num_scales: int = field(init=False)
    meta_bytes: int = field(init=False)
    code_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        scale_shape = tuple(1 if i == self.dim % len(self.shape) else n for i, n in enumerate(self.shape))
        object.__setattr__(self, "num_elements", math.prod(self.shape))
        object.__setattr__(self, "scale_shape", scale_shape)
        object.__setattr__(self, "num_scales", math.prod(scale_shape))
        object.__setattr__(self, "meta_bytes", self.num_scales * 2 * (2 if self.fmt.has_zero else 1))
        object.__setattr__(self, "code_bytes", self.fmt.code_bytes(self.num_elements))


def _grouped(rows: tuple[int, ...], width: int, group: int, fmt: Fmt, what: str) -> HalfPlan:
    if fmt is Fmt.INT4 and group % INT4_GROUP == 0:
        group = INT4_GROUP
    if width % group or (fmt is Fmt.INT4 and group % 2):
        raise ConfigError(f"{what} of {width} elements does not split into groups of {group}"
                          + (" (an even number for 4-bit values)" if fmt is Fmt.INT4 else ""))
    return HalfPlan(fmt, (*rows, width // group, group), -1)


class ScaledCodec(Codec):
    """INT8, FP8 or K8V4 (keys 8-bit, values 4-bit) of one block shape; see the module."""

    def __init__(self, kind: CodecKind, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 element_dtype: torch.dtype | None = None, group: int | None = None) -> None:
        self.kind = kind
        super().__init__(block_shape, dtype, element_dtype=element_dtype, group=group)
        elem = self.element_dtype
        if elem not in ROUNDING:
            raise ConfigError(f"the {kind.label} codec quantizes float32, float16 or bfloat16 KV, not {elem}"
                              + ("; give the KV's element dtype (codec_dtype)" if dtype == torch.uint8 else ""))
        if dtype != elem and dtype != torch.uint8:
            raise ConfigError(f"codec element dtype {elem} given for a {dtype} layout (only opaque uint8 ones)")
        k_fmt, v_fmt = FORMATS[kind]
        layers, two, tokens, heads, width = self.block_shape
        if dtype == torch.uint8:  # opaque: runs of `group` elements
            width = width // elem.itemsize
            if width * elem.itemsize != self.block_shape[-1]:
                raise ConfigError(f"a row of {self.block_shape[-1]} bytes is not whole {elem} elements")
            g = DEFAULT_GROUP if group is None else group
            rows: tuple[int, ...] = (layers, tokens * heads)
            self._plans = (_grouped(rows, width, g, k_fmt, "a key row"), _grouped(rows, width, g, v_fmt, "a value row"))
        else:
            rows = (layers, tokens, heads)
            keys = (HalfPlan(k_fmt, (layers, tokens, heads, width), 1) if tokens >= MIN_CHANNEL_TOKENS
                    else _grouped(rows, width, width, k_fmt, "a key head"))
            self._plans = (keys, _grouped(rows, width, width, v_fmt, "a value head"))
        self._elem_shape = (layers, two, tokens, heads, width)
        self._meta_offsets = (0, self._plans[0].meta_bytes)
        meta = sum(p.meta_bytes for p in self._plans)
        self._code_offsets = (meta, meta + self._plans[0].code_bytes)
        self.payload_bytes = meta + sum(p.code_bytes for p in self._plans)
        self._limit = float(torch.finfo(elem).max)
        # Both halves in the same format without zeros (INT8, FP8): encoded together.
        self._pairs = self._plans[0].fmt is self._plans[1].fmt and not self._plans[0].fmt.has_zero

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a block) as the element dtype, `[layers, 2, tokens, heads, width]`;
        RuntimeError if its strides allow no such view."""
        view = t.view(self.element_dtype) if self.dtype != self.element_dtype else t
        return view.view(self._elem_shape)

    def _halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of `t` (a block) as the element dtype, K and V apart, each in its plan's
        grouping shape; RuntimeError if its strides allow no such views."""
        return self._split(self._view(t))

    def _split(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_halves` of a block already in `_view`'s shape."""
        return view[:, 0].view(self._plans[0].shape), view[:, 1].view(self._plans[1].shape)

    def encode(self, src: torch.Tensor) -> bytearray | None:
        src = src.detach()
        try:  # the pair path needs only the element view (each op takes any strides)
            view = self._view(src)
            halves = None if self._pairs else self._split(view)
        except RuntimeError:  # strides a view cannot express: a contiguous copy
            src = src.contiguous()
            view = self._view(src)
            halves = None if self._pairs else self._split(view)
        limit = self._limit
        buf = bytearray(self.payload_bytes)
        device = src.device
        with one_thread():
            if halves is None:
                return self._encode_pair(view.transpose(0, 1), buf)
            for h, (plan, half) in enumerate(zip(self._plans, halves)):
                n_meta = plan.num_scales * (2 if plan.fmt.has_zero else 1)
                meta = torch.frombuffer(buf, dtype=torch.bfloat16, count=n_meta, offset=self._meta_offsets[h])
                codes = torch.frombuffer(buf, dtype=torch.uint8, count=plan.code_bytes, offset=self._code_offsets[h])
                target = codes if device.type == "cpu" else torch.empty(plan.code_bytes, dtype=torch.uint8,
                                                                        device=device)
                q = quantize(half, plan.dim, plan.fmt, target, limit)
                if q is None:
                    return None
                meta[: plan.num_scales].copy_(q.scale.reshape(-1))
                if q.zero is not None:
                    meta[plan.num_scales :].copy_(q.zero.reshape(-1))
                if target is not codes:  # the encoded bytes cross from the device, not the block
                    codes.copy_(target)
        return buf

    def _encode_pair(self, pair: torch.Tensor, buf: bytearray) -> bytearray | None:
        """`encode` of a block whose halves share a format without zeros (`quantize_pair`);
        `pair` is the block in the element dtype, `[2, layers, ...]`."""
        k, v = self._plans
        total = k.code_bytes + v.code_bytes
        codes = torch.frombuffer(buf, dtype=torch.uint8, count=total, offset=self._code_offsets[0])
        on_cpu = pair.device.type == "cpu"
        target = codes if on_cpu else torch.empty(total, dtype=torch.uint8, device=pair.device)
        got = quantize_pair(pair, (k.shape, v.shape), (k.dim, v.dim), k.fmt, target, self._limit)
        if got is None:
            return None
        # Both halves' scales, K's then V's, as their meta lies (no zeros: K's meta, then V's).
        torch.frombuffer(buf, dtype=torch.bfloat16, count=k.num_scales + v.num_scales, offset=0).copy_(got)
        if target is not codes:  # the encoded bytes cross from the device, not the block
            codes.copy_(target)
        return buf

    def _meta(self, payload: memoryview | bytes | bytearray, h: int, device: torch.device) -> tuple[
            torch.Tensor, torch.Tensor | None]:
        plan = self._plans[h]
        off, n = self._meta_offsets[h], plan.num_scales
        bits = np.frombuffer(payload, dtype=np.uint16, count=plan.meta_bytes // 2, offset=off)
        # On the bfloat16 bits: a scale is positive and finite iff 0 < bits < 0x7F80, a zero
        # finite iff its exponent is not all ones (one pass each over the small meta arrays).
        bad = not bool(np.all(bits[:n] - np.uint16(1) < np.uint16(0x7F7F)))
        if plan.fmt.has_zero:
            bad = bad or not bool(np.all(bits[n:] & np.uint16(0x7FFF) < np.uint16(0x7F80)))
        if bad:
            raise CorruptRecordError(f"{self.kind.label} payload has a scale that is not finite and positive"
                                     + (" or a zero that is not finite" if plan.fmt.has_zero else ""))
        raw = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
        scale = scratch("scale", plan.scale_shape, torch.float32, raw.device).copy_(raw[:n].view(plan.scale_shape))
        zero = raw[n:].view(plan.scale_shape).float() if plan.fmt.has_zero else None
        return scale.to(device), None if zero is None else zero.to(device)

    def decode(self, payload: memoryview | bytes | bytearray, dst: torch.Tensor) -> None:
        self.check_length(payload, self.payload_bytes)
        try:
            halves, target = self._halves(dst), dst
        except RuntimeError:
            target = torch.empty(self.block_shape, dtype=self.dtype)
            halves = self._halves(target)
        with one_thread():
            for h, (plan, half) in enumerate(zip(self._plans, halves)):
                scale, zero = self._meta(payload, h, half.device)
                codes = np.frombuffer(payload, dtype=np.uint8, count=plan.code_bytes, offset=self._code_offsets[h])
                on_device = codes if half.device.type == "cpu" else torch.from_numpy(codes.copy()).to(half.device)
                dequantize(on_device, plan.fmt, scale, zero, half)
        if target is not dst:
            dst.copy_(target)

    def error_bound(self, src: torch.Tensor) -> torch.Tensor:
        """The largest error each element of block `src` (finite) may have after a round
        trip: float32, shaped as `src` viewed in the element dtype."""
        return self._bound(src, error_bound)

    def reencoded_error_bound(self, src: torch.Tensor) -> torch.Tensor:
        """The largest error each element of block `src` (finite) may have after any number of
        round trips (decoded KV encoded again, as a promoted block demoted back down is), as
        `error_bound` (`tiers/codecs/quant.py`: `REENCODE_FACTOR`)."""
        return self._bound(src, reencoded_error_bound)

    def _bound(self, src: torch.Tensor, bound: Callable[[torch.Tensor, int, Fmt, torch.dtype], torch.Tensor]
               ) -> torch.Tensor:
        out = torch.empty(self._elem_shape, dtype=torch.float32)
        for h, (plan, half) in enumerate(zip(self._plans, self._halves(src.detach().cpu().contiguous()))):
            x = half.to(torch.float32, copy=True)
            out[:, h] = bound(x, plan.dim, plan.fmt, self.element_dtype).reshape(out[:, h].shape)
        return out


@dataclass(frozen=True)
class _ScaledConfig(CodecConfig):
    """The lossy codecs' configs: each opens a `ScaledCodec` of its kind."""

    def build(self, block_shape: tuple[int, ...], dtype: torch.dtype, *,
              element_dtype: torch.dtype | None = None, group: int | None = None) -> Codec:
        return ScaledCodec(self.kind, block_shape, dtype, element_dtype=element_dtype, group=group)


@register_codec("int8")
@dataclass(frozen=True)
class Int8Config(_ScaledConfig):
    kind = CodecKind.INT8


@register_codec("fp8")
@dataclass(frozen=True)
class FP8Config(_ScaledConfig):
    kind = CodecKind.FP8


@register_codec("k8v4")
@dataclass(frozen=True)
class K8V4Config(_ScaledConfig):
    kind = CodecKind.K8V4
