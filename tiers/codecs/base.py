"""The codec interface: one block-shaped tensor <-> one self-contained payload.

A codec turns a block (the tier's `[num_layers, 2, block_size, num_kv_heads, head_dim]` tensor
of the layout's dtype, on any device) into payload bytes, and a payload back into a
destination block. Everything a decoder needs beyond the block's shape (scales, the
compressed frame's length) is inside the payload, so a tier stores only the payload and the
codec's id; its checksum then covers every encoded byte. Ids are stable: they are written in
records and must never be reused for another encoding.

Each codec registers a config class of its own by its label (`register_codec`, `CODECS`); a
tier config names one as a label, a config object, or a dict `{"type": ..., "module_path":
...}` for a codec outside kvstrata, which declares its kind (`CodecKind.define`, an id of its
own from 128 up) and is then read and written by the disk and remote tiers like kvstrata's.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from tiers.errors import ConfigError, CorruptRecordError
from tiers.plugins import Registry

R = TypeVar("R", bound=type)


MAX_CODEC_ID = 255  # records keep the id in one byte
FIRST_OUTSIDE_ID = 128  # ids below are kvstrata's own; a codec outside kvstrata takes one from here

_LABEL = re.compile(r"[a-z][a-z0-9_]*\Z")


class _KindsMeta(type):
    """Iterating `CodecKind` yields kvstrata's own kinds, by id."""

    def __iter__(cls) -> Iterator[CodecKind]:
        return iter(_BUILTIN_KINDS)


class CodecKind(metaclass=_KindsMeta):
    """A payload encoding: `value` is its stable id in records (one byte), `label` its name in
    configs, `lossy` whether decoding returns other bytes than were encoded.

    An open set, interned by id (`CodecKind(2) is CodecKind.INT8`). kvstrata's own kinds take
    ids below `FIRST_OUTSIDE_ID`; a codec outside kvstrata declares its kind once with
    `CodecKind.define(label, codec_id, lossy=...)`, an id from `FIRST_OUTSIDE_ID` to
    `MAX_CODEC_ID` that it keeps for ever (records name it; a reader without the codec
    registered treats them as misses it leaves in place). In one process an id and a label
    each name one kind: a second, different definition is refused.
    """

    __slots__ = ("_label", "_lossy", "_value")
    NONE: ClassVar[CodecKind]  # the block's bytes as they are
    ZSTD: ClassVar[CodecKind]  # lossless: byte planes of each element apart, then zstd
    INT8: ClassVar[CodecKind]  # lossy: int8, keys scaled per channel, values per token and head
    FP8: ClassVar[CodecKind]  # lossy: fp8 e4m3 with the same scales as INT8
    K8V4: ClassVar[CodecKind]  # lossy: keys as INT8, values as 4-bit integers with a scale and zero per 32
    _by_id: ClassVar[dict[int, CodecKind]] = {}
    _by_label: ClassVar[dict[str, CodecKind]] = {}
    _value: int
    _label: str
    _lossy: bool

    def __new__(cls, value: int) -> CodecKind:
        """The kind of id `value`; `ValueError` if no kind has it (as an enum's lookup)."""
        kind = cls._by_id.get(value) if isinstance(value, int) and not isinstance(value, bool) else None
        if kind is None:
            raise ValueError(f"{value!r} is not a known codec id")
        return kind

    @classmethod
    def define(cls, label: str, codec_id: int, *, lossy: bool) -> CodecKind:
        """The kind of a codec outside kvstrata (see the class docstring); the same kind if
        it was defined already with these values. `ConfigError` for an id outside
        [`FIRST_OUTSIDE_ID`, `MAX_CODEC_ID`], a label that is not a lower-case identifier, or
        an id or label another kind has."""
        if not isinstance(codec_id, int) or isinstance(codec_id, bool) or \
                not FIRST_OUTSIDE_ID <= codec_id <= MAX_CODEC_ID:
            raise ConfigError(f"a codec outside kvstrata takes an id in [{FIRST_OUTSIDE_ID}, {MAX_CODEC_ID}], "
                              f"got {codec_id!r}")
        return cls._intern(label, codec_id, lossy)

    @classmethod
    def _intern(cls, label: str, codec_id: int, lossy: bool) -> CodecKind:
        if not isinstance(label, str) or not _LABEL.match(label):
            raise ConfigError(f"a codec's label is a lower-case identifier, got {label!r}")
        if not isinstance(lossy, bool):
            raise ConfigError(f"a codec's lossy flag is a bool, got {lossy!r}")
        same = cls._by_id.get(codec_id)
        if same is not None and (same.label, same.lossy) == (label, lossy):
            return same
        if same is not None:
            raise ConfigError(f"codec id {codec_id} is the {same.label} codec's already")
        if label in cls._by_label:
            raise ConfigError(f"the codec label {label!r} has id {cls._by_label[label].value} already")
        kind = object.__new__(cls)
        kind._value, kind._label, kind._lossy = codec_id, label, lossy
        cls._by_id[codec_id] = cls._by_label[label] = kind
        return kind

    @classmethod
    def of_label(cls, label: str) -> CodecKind | None:
        """The kind named `label` (kvstrata's, or one defined outside it); None if none is."""
        return cls._by_label.get(label)

    @classmethod
    def of_id(cls, codec_id: int) -> CodecKind | None:
        """The kind of id `codec_id`; None if none has it."""
        return cls._by_id.get(codec_id)

    @classmethod
    def defined(cls) -> list[CodecKind]:
        """Every kind defined in this process (kvstrata's and those outside it), by id."""
        return [cls._by_id[i] for i in sorted(cls._by_id)]

    @property
    def value(self) -> int:
        """The stable id records carry."""
        return self._value

    @property
    def label(self) -> str:
        """The name a config uses ("none", "zstd", "int8", "fp8", "k8v4", ...)."""
        return self._label

    @property
    def name(self) -> str:
        """The label in capitals (as an enum member's name)."""
        return self._label.upper()

    @property
    def lossy(self) -> bool:
        """Whether decoding returns other bytes than were encoded."""
        return self._lossy

    def __repr__(self) -> str:
        if self._value < FIRST_OUTSIDE_ID:
            return f"CodecKind.{self.name}"
        return f"CodecKind({self._label!r}, {self._value})"

    def __reduce__(self) -> tuple[type[CodecKind], tuple[int]]:
        return CodecKind, (self._value,)  # copies and pickles are the interned kind


CodecKind.NONE = CodecKind._intern("none", 0, False)
CodecKind.ZSTD = CodecKind._intern("zstd", 1, False)
CodecKind.INT8 = CodecKind._intern("int8", 2, True)
CodecKind.FP8 = CodecKind._intern("fp8", 3, True)
CodecKind.K8V4 = CodecKind._intern("k8v4", 4, True)
_BUILTIN_KINDS = (CodecKind.NONE, CodecKind.ZSTD, CodecKind.INT8, CodecKind.FP8, CodecKind.K8V4)


def parse_codec(value: object, what: str = "codec") -> CodecKind:
    """`value` (a `CodecKind` or its label) as a `CodecKind`; `ConfigError` naming it otherwise.
    A label outside kvstrata's is known once its codec's module is imported."""
    if isinstance(value, CodecKind):
        return value
    if isinstance(value, str):
        kind = CodecKind.of_label(value.strip().lower())
        if kind is not None:
            return kind
    others = [k.label for k in CodecKind.defined() if k not in _BUILTIN_KINDS]
    besides = f" (or one registered outside kvstrata: {others})" if others else ""
    raise ConfigError(f"{what} must be one of {[k.label for k in CodecKind]}, got {value!r}{besides}")


def codec_of_id(codec_id: int) -> CodecKind | None:
    """The codec a record's id names; None for an id this reader does not know."""
    return CodecKind.of_id(codec_id)


class Codec(abc.ABC):
    """Encodes blocks of one shape and dtype.

    `decode` never trusts a payload: a wrong length, a frame that does not decode or a scale
    that is not finite raises `CorruptRecordError` (the tier counts it and treats it as damage).
    Encoding and decoding keep no state between calls (the lossy codecs reuse per-thread
    scratch memory): one instance serves many threads.

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

    `element_dtype` and `group` are the `Codec` arguments of the same names; `config` is the
    config `kind`'s codec is built from for writing (None: its registered defaults).
    """

    kind: CodecKind = CodecKind.NONE
    element_dtype: torch.dtype | None = None
    group: int | None = None
    accepted: frozenset[CodecKind] = frozenset()
    config: CodecConfig | None = None

    def __post_init__(self) -> None:
        if self.config is not None and self.config.kind is not self.kind:
            raise ConfigError(f"CodecSpec.config is a {self.config.kind.label} codec's, not {self.kind.label}'s")

    def accepts(self, kind: CodecKind) -> bool:
        return not kind.lossy or kind is self.kind or kind in self.accepted


@dataclass(frozen=True)
class CodecConfig(abc.ABC):
    """A codec's config: a frozen dataclass registered with `register_codec` under its kind's
    label, whose `build` opens the codec for one block layout.

    A record names only its codec's id, so a reader builds the decoder from the registered
    config's defaults: a field may tune how blocks are encoded, but whatever decoding needs
    must be inside the payload.
    """

    kind: ClassVar[CodecKind]

    @property
    def lossy(self) -> bool:
        return self.kind.lossy

    @abc.abstractmethod
    def build(self, block_shape: tuple[int, ...], dtype: torch.dtype, *,
              element_dtype: torch.dtype | None = None, group: int | None = None) -> Codec:
        """The codec for blocks of `block_shape` and `dtype` (arguments as `Codec`'s). Raises
        `ConfigError` if it cannot encode them (a lossy codec on integer KV, groups that do
        not divide a row) or its library is missing (naming what to install)."""


CODECS: Registry[CodecConfig] = Registry("codec", CodecConfig, ("tiers.codecs",))


def register_codec(name: str) -> Callable[[R], R]:
    """Class decorator: register a `CodecConfig` subclass under `name`, its kind's label."""

    def add(config_cls: R) -> R:
        kind = getattr(config_cls, "kind", None)
        if not isinstance(kind, CodecKind) or kind.label != name:
            raise ConfigError(f"the codec config {config_cls.__qualname__} registered as {name!r} must declare "
                              f"`kind`, a CodecKind labelled {name!r}; got {kind!r}")
        CODECS.add(name, config_cls)
        return config_cls

    return add


def codec_config(value: object, what: str = "codec") -> CodecConfig:
    """`value` as a codec config: a `CodecConfig`, a `CodecKind` or its label (its defaults),
    or a dict with its `type` (`tiers/plugins.py`); `ConfigError` naming `what` otherwise."""
    if isinstance(value, CodecKind):
        value = value.label
    if isinstance(value, str):
        value = value.strip().lower()
    return CODECS.config_from(value, what=what)
