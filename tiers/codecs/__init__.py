"""Block codecs of the slow tiers: `CodecKind` names one, `build_codec` opens it.

`base.py` holds the interface; one file per encoding beside it: `raw.py` (the bytes as they
are), `zstd.py` (lossless), `scaled.py` over `quant.py` (8-bit and 4-bit, lossy).
"""

from __future__ import annotations

import torch

from tiers.codecs.base import Codec, CodecKind, CodecSpec, codec_of_id, parse_codec
from tiers.codecs.raw import RawCodec
from tiers.codecs.scaled import ScaledCodec
from tiers.codecs.zstd import ZstdCodec

__all__ = ["Codec", "CodecKind", "CodecSpec", "build_codec", "codec_of_id", "parse_codec"]


def build_codec(kind: CodecKind, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                element_dtype: torch.dtype | None = None, group: int | None = None) -> Codec:
    """The codec `kind` for blocks of `block_shape` and `dtype`. Raises `ConfigError` if it
    cannot encode them (a lossy codec on integer KV, groups that do not divide a row) or its
    library is missing (naming the extra to install)."""
    if kind is CodecKind.NONE:
        return RawCodec(block_shape, dtype, element_dtype=element_dtype, group=group)
    if kind is CodecKind.ZSTD:
        return ZstdCodec(block_shape, dtype, element_dtype=element_dtype, group=group)
    return ScaledCodec(kind, block_shape, dtype, element_dtype=element_dtype, group=group)
