"""Lossless: the bytes of each element split into planes (all first bytes, then all second
bytes, ...), then one zstd frame.

KV in 16-bit floats barely compresses as it is: the low byte of each element is mantissa,
close to random. Its high byte (sign and exponent) is skewed, and zstd's entropy coder packs
it once the high bytes sit together. Decoding is bit-exact. Needs the `zstandard` package
(`pip install 'kvstrata[codec]'`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from tiers.codecs.base import Codec, CodecConfig, CodecKind, register_codec
from tiers.codecs.quant import scratch
from tiers.errors import ConfigError, CorruptRecordError
from tiers.shared.blockcopy import host_bytes

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
LEVEL = 1  # zstd's level: 1 packs these planes as well as 3 and is twice as fast (docs/performance.md)
EXTRA = "pip install 'kvstrata[codec]'  (the zstandard package)"


def _np_scratch(slot: str, shape: tuple[int, ...], dtype: type[np.unsignedinteger]) -> np.ndarray:
    """This thread's reused host buffer `slot` (`tiers/codecs/quant.py`), as NumPy."""
    torch_dtype = {np.uint8: torch.uint8, np.uint16: torch.uint16, np.uint32: torch.uint32, np.uint64: torch.uint64}
    return scratch(f"zstd_{slot}", shape, torch_dtype[dtype], torch.device("cpu")).numpy()


def zstd_module() -> ModuleType:
    """The `zstandard` module; `ConfigError` naming the extra to install if it is missing."""
    try:
        import zstandard
    except ImportError:
        raise ConfigError(f"the zstd codec needs the zstandard package: {EXTRA}") from None
    return zstandard


class ZstdCodec(Codec):
    """Byte planes of `element_dtype`'s elements, compressed as one zstd frame (level `LEVEL`).

    The frame states its decoded size; a frame that would not decode to exactly one block is
    refused before any byte is decompressed.
    """

    kind = CodecKind.ZSTD

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 element_dtype: torch.dtype | None = None, group: int | None = None) -> None:
        super().__init__(block_shape, dtype, element_dtype=element_dtype, group=group)
        self._zstd = zstd_module()
        self._width = self.element_dtype.itemsize  # bytes per element: the number of planes

    def _planes(self, raw: np.ndarray) -> np.ndarray:
        """`raw` (the block's bytes, contiguous) with byte k of every element in plane k, in
        this thread's scratch. Little-endian, byte k is `(element >> 8k) & 0xFF`: one shift
        and one narrowing pass per plane over whole-element integers (a strided byte
        transpose is 5x slower)."""
        w = self._width
        if w == 1:
            return raw
        if sys.byteorder != "little" or w not in _UINT:
            return np.ascontiguousarray(raw.reshape(-1, w).T)
        elems = raw.view(_UINT[w])
        out = _np_scratch("planes", (w, elems.size), np.uint8)
        shifted = _np_scratch("shifted", (elems.size,), _UINT[w])
        np.copyto(out[0], elems, casting="unsafe")  # the low byte
        for k in range(1, w):
            np.copyto(out[k], np.right_shift(elems, 8 * k, out=shifted), casting="unsafe")
        return out

    def _join(self, planes: np.ndarray, dst: np.ndarray) -> None:
        """Write the elements of `planes` ([width, n] bytes) into `dst` (the block's bytes,
        contiguous): from the top plane down, shift left a byte and OR the next plane in
        (little-endian; a strided byte transpose, 20x slower, elsewhere)."""
        w = self._width
        if sys.byteorder != "little" or w not in _UINT:
            np.copyto(dst.reshape(-1, w), planes.T)
            return
        elems = dst.view(_UINT[w])
        np.copyto(elems, planes[w - 1], casting="unsafe")
        for k in range(w - 2, -1, -1):
            np.left_shift(elems, 8, out=elems)
            np.bitwise_or(elems, planes[k], out=elems, casting="unsafe")

    def encode(self, src: torch.Tensor) -> bytes:
        host = src.detach()
        raw = host_bytes(host) if host.is_contiguous() else None
        if raw is None:
            host = host.to("cpu").contiguous()
            raw = host_bytes(host)
            assert raw is not None  # a contiguous host tensor has a byte view
        frame: bytes = self._zstd.ZstdCompressor(level=LEVEL).compress(self._planes(raw.reshape(-1)))
        return frame

    def decode(self, payload: memoryview | bytes | bytearray, dst: torch.Tensor) -> None:
        zstd = self._zstd
        try:
            size = zstd.frame_content_size(payload)
        except zstd.ZstdError as exc:
            raise CorruptRecordError(f"zstd payload has no readable frame header: {exc}") from None
        if size != self.block_bytes:
            raise CorruptRecordError(f"zstd frame decodes to {size} bytes, expected a block of {self.block_bytes}")
        try:
            planes = zstd.ZstdDecompressor().decompress(payload, max_output_size=self.block_bytes)
        except zstd.ZstdError as exc:
            raise CorruptRecordError(f"zstd payload does not decode: {exc}") from None
        self.check_length(planes, self.block_bytes)
        flat = np.frombuffer(planes, dtype=np.uint8)
        view = host_bytes(dst) if dst.is_contiguous() else None
        target = dst if view is not None else torch.empty(self.block_shape, dtype=self.dtype)
        if view is None:
            view = host_bytes(target)
            assert view is not None
        if self._width == 1:
            np.copyto(view.reshape(-1), flat)
        else:
            self._join(flat.reshape(self._width, -1), view.reshape(-1))
        if target is not dst:
            dst.copy_(target)


@register_codec("zstd")
@dataclass(frozen=True)
class ZstdConfig(CodecConfig):
    """Lossless: byte planes, then zstd (the `codec` extra)."""

    kind = CodecKind.ZSTD

    def build(self, block_shape: tuple[int, ...], dtype: torch.dtype, *,
              element_dtype: torch.dtype | None = None, group: int | None = None) -> Codec:
        return ZstdCodec(block_shape, dtype, element_dtype=element_dtype, group=group)
