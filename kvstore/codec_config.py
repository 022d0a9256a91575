"""The codecs of a store's tiers: checked against its layout, the lossy ones a store reads, and
the part of them that enters its identity.

Isolation rule: a lossy codec on a tier changes the bytes a store may return, so it enters
`StoreConfig.identity()` (the root of every key): a store that accepts lossy bytes and one
that wants exact KV share no key in any tier, and stores accepting different lossy codecs
share none either. A lossless codec changes no byte a reader gets and stays out. Which
codecs these are is read from each tier config's `codec`, whatever the tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvstore.errors import ConfigError
from kvstore.layout import parse_dtype
from tiers.codecs import CodecConfig, CodecKind
from tiers.tier_config import TierConfig


def parse_codec_dtype(value: object, layout_dtype: torch.dtype) -> torch.dtype | None:
    """`StoreConfig.codec_dtype` as a torch dtype (or None); `ConfigError` for an unknown one,
    or one other than the layout's on a layout that is not opaque uint8 bytes."""
    if value is None:
        return None
    dtype = parse_dtype(value, "StoreConfig.codec_dtype")
    if layout_dtype != torch.uint8 and dtype != layout_dtype:
        raise ConfigError(f"StoreConfig.codec_dtype={dtype} differs from the layout's {layout_dtype}; "
                          "it is for opaque uint8 layouts only")
    return dtype


def check_tier_codecs(codecs: Sequence[tuple[str, CodecConfig | None]], block_shape: tuple[int, ...],
                      dtype: torch.dtype, codec_dtype: torch.dtype | None, group: int | None) -> None:
    """Open each tier's codec (`what`, config) other than raw once on the layout: a missing
    library, an integer KV dtype for a lossy codec, or groups that do not divide a row raise
    `ConfigError` naming `what`."""
    for what, codec in codecs:
        if codec is not None and codec.kind is not CodecKind.NONE:
            try:
                codec.build(block_shape, dtype, element_dtype=codec_dtype, group=group)
            except ConfigError as exc:
                raise ConfigError(f"{what}={codec.kind.label!r}: {exc}") from None


def lossy_kinds(tiers: Iterable[TierConfig]) -> frozenset[CodecKind]:
    """The lossy codecs the tiers write: what every tier of the store reads besides exact KV."""
    return frozenset(t.codec.kind for t in tiers if t.codec is not None and t.codec.lossy)


def lossy_codecs(tiers: Iterable[TierConfig]) -> list[str]:
    """The lossy codecs of `tiers`, sorted by name (empty: every tier is exact)."""
    return sorted(k.label for k in lossy_kinds(tiers))


def codec_identity(tiers: Iterable[TierConfig], codec_dtype: torch.dtype | None, group: int | None) -> list[object]:
    """What of the codec settings enters the identity: nothing for exact stores, else the
    lossy codecs with the element dtype and group they quantize with."""
    lossy = lossy_codecs(tiers)
    if not lossy:
        return []
    dtype = None if codec_dtype is None else str(codec_dtype).removeprefix("torch.")
    return [["lossy", lossy, dtype, group]]
