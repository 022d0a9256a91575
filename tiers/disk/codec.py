"""The disk tier's codecs: what a block is written as, the slot it takes, and which entries
this reader decodes.

A tier writes with one codec (`CodecSpec.kind`; `none` writes raw bytes). A block the codec
cannot represent (non-finite values for a lossy codec) or does not shrink (noise through
zstd) is written raw. A lossy codec's payload has a length fixed by the block's shape, so its
blocks take slots of that size (`encoded_slot_bytes`: whole pages for payloads of 64 KiB and
more, whole 512-byte sectors below, where pages would eat the gain): capacity and bandwidth
both gain.
zstd's payloads vary, so they keep raw-size slots; only their encoded length is written and
read. Raw fallbacks take raw-size slots whatever the codec.

An entry's layout tag says what its payload is: the block's dtype and shape, and for an
encoded payload its codec and what that codec's decoding depends on (the element dtype; for
a lossy codec also the group). A reader decodes an entry only if it knows the codec, accepts
it (`CodecSpec.accepts`: never lossy bytes for an exact reader), can load it (its library),
and would have written the same tag; otherwise the block is a miss and stays
(`UnverifiableRecordError`). A raw entry of another layout is damage.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import xxhash

from tiers.codecs import Codec, CodecKind, CodecSpec
from tiers.codecs.records import LayoutCodecs
from tiers.codecs.scaled import ScaledCodec
from tiers.disk.files import slot_bytes_for
from tiers.disk.index import CODEC_RAW, Entry
from tiers.errors import CorruptRecordError, UnverifiableRecordError

_SECTOR = 512
_PAGES_FROM = 64 << 10  # payloads from this size take whole pages (at most 6% of slack)


def encoded_slot_bytes(payload_bytes: int) -> int:
    """The slot of a fixed-size encoded payload (see the module docstring)."""
    if payload_bytes >= _PAGES_FROM:
        return slot_bytes_for(payload_bytes)
    return -(-payload_bytes // _SECTOR) * _SECTOR


class Encoded(NamedTuple):
    """A block as its codec wrote it: codec id, layout tag, slot size and payload."""

    codec_id: int
    layout: int
    slot_bytes: int
    data: bytes | bytearray


class DiskCodec:
    """The codecs of one disk tier's layout (see the module docstring); thread-safe once
    built (codecs keep no state between calls)."""

    def __init__(self, spec: CodecSpec | None, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._codecs = LayoutCodecs(spec, block_shape, dtype)
        self.spec = self._codecs.spec
        self._shape, self._dtype = tuple(block_shape), dtype
        self.block_bytes = int(np.prod(block_shape)) * dtype.itemsize
        self.raw_slot_bytes = slot_bytes_for(self.block_bytes)
        self.raw_layout = xxhash.xxh32_intdigest(f"{dtype}:{list(block_shape)}".encode())
        self._writer = None if self.spec.kind is CodecKind.NONE else self._codecs.get(self.spec.kind)  # ConfigError
        fixed = self._writer.payload_bytes if isinstance(self._writer, ScaledCodec) else None
        slot = None if fixed is None else encoded_slot_bytes(fixed)
        self._fixed_slot = slot if slot is not None and slot < self.raw_slot_bytes else None
        self._write_layout = 0 if self._writer is None else self._tag(self._writer)
        # the slot most blocks take (capacity estimates)
        self.slot_bytes = self._fixed_slot or self.raw_slot_bytes

    def _tag(self, codec: Codec) -> int:
        group = codec.group if codec.lossy else None
        what = f"{self._dtype}:{list(self._shape)}:{codec.kind.value}:{codec.element_dtype}:{group}"
        return xxhash.xxh32_intdigest(what.encode())

    def encode(self, src: torch.Tensor) -> Encoded | None:
        """The block `src` through this tier's codec; None to write it raw (no codec, or one
        that cannot represent it or does not make it smaller)."""
        if self._writer is None:
            return None
        data = self._writer.encode(src)
        if data is None or len(data) >= self.block_bytes:
            return None
        slot = self._fixed_slot if self._fixed_slot is not None else self.raw_slot_bytes
        return Encoded(self.spec.kind.value, self._write_layout, slot, data)

    def check(self, e: Entry) -> None:
        """Raise `CorruptRecordError` if `e` cannot be an entry of this layout, or
        `UnverifiableRecordError` if it is sound but this reader does not decode it."""
        if e.codec == CODEC_RAW:
            if e.layout != self.raw_layout or e.length != self.block_bytes or e.slot_bytes != self.raw_slot_bytes:
                raise CorruptRecordError("entry layout differs from this tier's")
            return
        codec = self._codecs.reader(e.codec, "payload")
        if e.layout != self._tag(codec):
            raise UnverifiableRecordError(f"{codec.kind.label} payload encoded with another element dtype or group")

    def decode(self, e: Entry, payload: np.ndarray, dst: torch.Tensor) -> None:
        """Decode a checked, verified encoded payload into `dst`; `CorruptRecordError` if it
        does not decode (`dst` may then hold part of the block)."""
        self._codecs.reader(e.codec, "payload").decode(payload.data, dst)  # `check` passed: known
