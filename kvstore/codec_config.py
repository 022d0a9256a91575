"""The codec settings of a `StoreConfig`: parsed, checked against its layout and tiers, and the
part of them that enters the store's identity.

Isolation rule: a lossy codec on an enabled tier changes the bytes a store may return, so it
enters `StoreConfig.identity()` (the root of every key): a store that accepts lossy bytes
and one that wants exact KV share no key in any tier, and stores accepting different lossy
codecs share none either. A lossless codec changes no byte a reader gets and stays out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.errors import ConfigError
from tiers.codecs import CodecKind, build_codec, parse_codec

if TYPE_CHECKING:
    from kvstore.config import StoreConfig


def check_codecs(config: StoreConfig) -> None:
    """Parse `disk_codec`, `remote_codec` and `codec_dtype` in place and open each enabled
    tier's codec once on the layout (a missing library, an integer KV dtype for a lossy
    codec, or groups that do not divide a row raise `ConfigError` naming the field)."""
    from kvstore.config import _DTYPES, require_int

    for name in ("disk_codec", "remote_codec"):
        object.__setattr__(config, name, parse_codec(getattr(config, name), f"StoreConfig.{name}"))
    if config.codec_dtype is not None:
        dtype = config.codec_dtype
        if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
            dtype = _DTYPES[dtype.removeprefix("torch.")]
        if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") not in _DTYPES:
            raise ConfigError(f"StoreConfig.codec_dtype must be one of {sorted(_DTYPES)}, got {config.codec_dtype!r}")
        object.__setattr__(config, "codec_dtype", dtype)
        if config.layout.dtype != torch.uint8 and dtype != config.layout.dtype:
            raise ConfigError(f"StoreConfig.codec_dtype={dtype} differs from the layout's {config.layout.dtype}; "
                              "it is for opaque uint8 layouts only")
    if config.codec_group is not None:
        require_int("StoreConfig.codec_group", config.codec_group, 1)
    for name, kind, enabled in (("disk_codec", config.disk_codec, config.disk_path is not None),
                                ("remote_codec", config.remote_codec, config.remote_url is not None)):
        if kind is not CodecKind.NONE and enabled:
            try:
                build_codec(kind, config.block_shape, config.layout.dtype, element_dtype=config.codec_dtype,
                            group=config.codec_group)
            except ConfigError as exc:
                raise ConfigError(f"StoreConfig.{name}={kind.label!r}: {exc}") from None


def lossy_codecs(config: StoreConfig) -> list[str]:
    """The lossy codecs of the enabled tiers, sorted by name (empty: every tier is exact)."""
    kinds = {k for k, on in ((config.disk_codec, config.disk_path is not None),
                             (config.remote_codec, config.remote_url is not None)) if on and k.lossy}
    return sorted(k.label for k in kinds)


def codec_identity(config: StoreConfig) -> list[object]:
    """What of the codec settings enters the identity: nothing for exact stores, else the
    lossy codecs with the element dtype and group they quantize with."""
    lossy = lossy_codecs(config)
    if not lossy:
        return []
    dtype = None if config.codec_dtype is None else str(config.codec_dtype).removeprefix("torch.")
    return [["lossy", lossy, dtype, config.codec_group]]
