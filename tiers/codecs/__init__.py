"""Block codecs of the slow tiers: `CodecKind` names one, `build_codec` opens it.

`base.py` holds the interface and the registry (`CODECS`); one file per encoding beside it,
each registering its config: `raw.py` (the bytes as they are), `zstd.py` (lossless),
`scaled.py` over `quant.py` (8-bit and 4-bit, lossy; `threads.py` holds their ops to the
calling thread).
"""

from __future__ import annotations

import torch

from tiers.codecs.base import (
    CODECS,
    Codec,
    CodecConfig,
    CodecKind,
    CodecSpec,
    codec_config,
    codec_of_id,
    parse_codec,
    register_codec,
)
from tiers.codecs.raw import RawConfig
from tiers.codecs.scaled import FP8Config, Int8Config, K8V4Config
from tiers.codecs.zstd import ZstdConfig
from tiers.errors import ConfigError

__all__ = ["CODECS", "Codec", "CodecConfig", "CodecKind", "CodecSpec", "FP8Config", "Int8Config", "K8V4Config",
           "RawConfig", "ZstdConfig", "build_codec", "codec_config", "codec_of_id", "parse_codec", "register_codec"]


def build_codec(kind: CodecKind, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                element_dtype: torch.dtype | None = None, group: int | None = None,
                config: CodecConfig | None = None) -> Codec:
    """The codec `kind` for blocks of `block_shape` and `dtype`, built from `config` (None:
    the registered config's defaults). Raises `ConfigError` if no codec of `kind` is
    registered, or it cannot encode such blocks (a lossy codec on integer KV, groups that do
    not divide a row) or its library is missing (naming the extra to install)."""
    if config is None:
        config = CODECS.get(kind.label)()
    elif config.kind is not kind:
        raise ConfigError(f"a {config.kind.label} codec's config given to build the {kind.label} codec")
    return config.build(block_shape, dtype, element_dtype=element_dtype, group=group)
