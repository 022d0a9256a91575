"""The codec interface: one block-shaped tensor <-> one self-contained payload.

A codec turns a block (the tier's `[num_layers, 2, block_size, num_kv_heads, head_dim]` tensor
of the layout's dtype, on any device) into payload bytes, and a payload back into a
destination block. Everything a decoder needs beyond the block's shape (scales, the
compressed frame's length) is inside the payload, so a tier stores only the payload and the
codec's id; its checksum then covers every encoded byte. Ids are stable: they are written in
records and must never be reused for another encoding.
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass

import torch

from tiers.errors import ConfigError, CorruptRecordError


class CodecKind(enum.Enum):
    """A payload encoding. The value is its stable id in records; the name is the config's."""

    NONE = 0  # the block's bytes as they are
    ZSTD = 1  # lossless: byte planes of each element apart, then zstd
    INT8 = 2  # lossy: int8, keys scaled per channel, values per token and head
    FP8 = 3  # lossy: fp8 e4m3 with the same scales as INT8
    K8V4 = 4  # lossy: keys as INT8, values as 4-bit integers with a scale and zero per 32

    @property
    def label(self) -> str:
        """The name a config uses ("none", "zstd", "int8", "fp8", "k8v4")."""
        return self.name.lower()

    @property
    def lossy(self) -> bool:
        """Whether decoding returns other bytes than were encoded."""
        return self not in (CodecKind.NONE, CodecKind.ZSTD)


def parse_codec(value: object, what: str = "codec") -> CodecKind:
    """`value` (a `CodecKind` or its name) as a `CodecKind`; `ConfigError` naming it otherwise."""
    if isinstance(value, CodecKind):
        return value
    if isinstance(value, str):
        for kind in CodecKind:
            if kind.label == value.strip().lower():
                return kind
    raise ConfigError(f"{what} must be one of {[k.label for k in CodecKind]}, got {value!r}")


def codec_of_id(codec_id: int) -> CodecKind | None:
    """The codec a record's id names; None for an id this reader does not know."""
    try:
        return CodecKind(codec_id)
    except ValueError:
        return None


class Codec(abc.ABC):
    """Encodes blocks of one shape and dtype.

    `decode` never trusts a payload: a wrong length, a frame that does not decode or a scale
    that is not finite raises `CorruptRecordError` (the tier counts it and treats it as damage).
    Encoding and decoding keep no state between calls: one instance serves many threads.

    Args:
        block_shape: the block's shape in the tier's dtype.
        dtype: the tier's dtype (uint8 for engines whose blocks are opaque bytes).
        element_dtype: the dtype the KV really has when `dtype` is uint8 (a lossy codec needs
            it; the lossless one uses its element size); None: `dtype` itself.
        group: elements per scale group of an opaque (uint8) block; None: the codec's default.
    """

    kind: CodecKind

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 element_dtype: torch.dtype | None = None, group: int | None = None) -> None:
        self.block_shape = tuple(int(n) for n in block_shape)
        self.dtype = dtype
        self.element_dtype = element_dtype or dtype
        self.group = group
        self.block_bytes = math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        if self.block_bytes % self.element_dtype.itemsize:
            raise ConfigError(f"a block of {self.block_bytes} bytes is not a whole number of "
                              f"{self.element_dtype} elements")

    @property
    def lossy(self) -> bool:
        return self.kind.lossy

    @abc.abstractmethod
    def encode(self, src: torch.Tensor) -> bytes | bytearray | None:
        """The payload of block `src` (shape `block_shape`, dtype `dtype`, any device); `src`
        is not changed. None if this codec cannot represent it within its bound (a lossy
        codec given infinite or NaN values): the caller stores the block raw instead."""

    @abc.abstractmethod
    def decode(self, payload: memoryview | bytes | bytearray, dst: torch.Tensor) -> None:
        """Write the block `payload` encodes into `dst` (shape `block_shape`, dtype `dtype`,
        any device or strides). Raises `CorruptRecordError` for a malformed payload; `dst`
        may then hold part of the block."""

    def check_length(self, payload: memoryview | bytes | bytearray, expected: int) -> None:
        if len(payload) != expected:
            raise CorruptRecordError(f"{self.kind.label} payload of {len(payload)} bytes, expected {expected}")


@dataclass(frozen=True)
class CodecSpec:
    """A tier's codecs: `kind` encodes what it writes; a record of any lossless codec, of
    `kind`, or of a lossy codec in `accepted` is read. A lossy record outside these is
    refused: a reader that wants exact KV never decodes lossy bytes.

    `element_dtype` and `group` are the `Codec` arguments of the same names.
    """

    kind: CodecKind = CodecKind.NONE
    element_dtype: torch.dtype | None = None
    group: int | None = None
    accepted: frozenset[CodecKind] = frozenset()

    def accepts(self, kind: CodecKind) -> bool:
        return not kind.lossy or kind is self.kind or kind in self.accepted
