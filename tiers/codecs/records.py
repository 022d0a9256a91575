"""Checks the self-checking records of the disk and remote tiers share: which codec decodes
a payload for this reader, and whether a record's token ids are the key's.

A payload of a codec this reader does not know, cannot build (its library missing) or does
not accept (`CodecSpec.accepts`: never lossy bytes for an exact reader) is an
`UnverifiableRecordError`, as is a record without token ids for a reader that verifies them:
a miss that stays stored. Token ids that differ are damage (`CorruptRecordError`).
"""

from __future__ import annotations

import torch

from tiers.codecs import Codec, CodecKind, CodecSpec, build_codec, codec_of_id
from tiers.errors import ConfigError, CorruptRecordError, UnverifiableRecordError


class LayoutCodecs:
    """The codecs of one block layout under one `CodecSpec`, each built once on first use;
    thread-safe once built (codecs keep no state between calls)."""

    def __init__(self, spec: CodecSpec | None, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.spec = spec or CodecSpec()
        self._shape, self._dtype = tuple(block_shape), dtype
        self._codecs: dict[CodecKind, Codec] = {}

    def get(self, kind: CodecKind) -> Codec:
        """This layout's codec `kind`; `ConfigError` if it cannot be built."""
        codec = self._codecs.get(kind)
        if codec is None:
            spec = self.spec
            config = spec.config if spec.config is not None and kind is spec.kind else None  # the writer's own
            codec = self._codecs[kind] = build_codec(kind, self._shape, self._dtype, element_dtype=spec.element_dtype,
                                                     group=spec.group, config=config)
        return codec

    def reader(self, codec_id: int, what: str) -> Codec:
        """The codec that decodes a `what` ("record", "payload") of codec id `codec_id` for this
        reader; `UnverifiableRecordError` if it does not know, accept or build that codec."""
        kind = codec_of_id(codec_id)
        if kind is None:
            raise UnverifiableRecordError(f"{what} of codec id {codec_id}, unknown to this reader")
        if not self.spec.accepts(kind):
            raise UnverifiableRecordError(f"{what} of the lossy codec {kind.label}, which this reader does not accept")
        try:
            return self.get(kind)
        except ConfigError as exc:
            raise UnverifiableRecordError(f"{what} this reader cannot decode: {exc}") from None


def check_tokens(verify_tokens: bool, expected: bytes, stored: bytes, what: str) -> None:
    """With `verify_tokens` and a key that has token ids (`expected`), raise unless a `what`'s
    stored token ids are the key's: `UnverifiableRecordError` if it has none (written with
    `verify_tokens=False`: sound), `CorruptRecordError` if they differ."""
    if verify_tokens and expected and stored != expected:
        if not stored:
            raise UnverifiableRecordError(f"{what} carries no token ids to verify")
        raise CorruptRecordError("token ids differ (hash collision or damage)")
