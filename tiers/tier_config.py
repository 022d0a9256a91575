"""Tier configs: what a tier needs to open, registered by name beside the tier.

Each tier has a frozen config class of its own (`TierConfig`) that validates its own fields
and opens the tier (`open`) with a `TierContext`: what every tier of one store shares (the
block layout, the namespace, whether tokens are verified, the codecs the store reads). A
store is configured by a sequence of tier configs, fastest first (`kvstore.StoreConfig.tiers`).

A tier registers its config with `register_tier(name)` in its own module; the built-ins'
modules are `BUILTIN_TIERS`. A tier outside kvstrata is named in a config as
`{"type": NAME_OR_CLASS, "module_path": "pkg.mod", ...its fields}` (`tiers/plugins.py`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar, TypeVar

import torch

from tiers.base import Tier, TierTraits
from tiers.codecs import CodecConfig, CodecKind, CodecSpec
from tiers.errors import ConfigError
from tiers.keys import BlockHash
from tiers.plugins import Registry

R = TypeVar("R", bound=type)

# The built-in tiers' config modules, fastest first: their order is `TIERS.entries()`'s.
BUILTIN_TIERS = ("tiers.pool.config", "tiers.cpu.config", "tiers.disk.config", "tiers.remote.config",
                 "tiers.mooncake.config",
                 "tiers.sharedfs.config")


@dataclass(frozen=True)
class TierContext:
    """What every tier of one store may need besides its own config.

    Attributes:
        block_shape: a block's tensor shape, `[num_layers, 2, block_size, heads, head_dim]`.
        dtype: the blocks' dtype (uint8 for engines whose blocks are opaque bytes).
        namespace: the store's namespace seed (the root of its hash chains): a tier that
            other stores share keeps each store's blocks under it.
        identity: what made the namespace (the store's `identity()`), for a tier that
            records who registered a namespace.
        verify_tokens: keep token ids beside each block; a hit whose tokens differ is a miss.
        codec_dtype: the KV's element dtype a codec quantizes opaque bytes as (None: `dtype`).
        codec_group: elements per scale of a lossy codec on opaque bytes (None: its default).
        accepted_codecs: the lossy codecs this store's identity admits: every tier reads them.
        remote_password: the password of a server whose URL has none (never shown).
    """

    block_shape: tuple[int, ...]
    dtype: torch.dtype
    namespace: BlockHash
    identity: object = None
    verify_tokens: bool = True
    codec_dtype: torch.dtype | None = None
    codec_group: int | None = None
    accepted_codecs: frozenset[CodecKind] = frozenset()
    remote_password: str | None = field(default=None, repr=False)

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        count = 1
        for n in self.block_shape:
            count *= n
        return count * self.dtype.itemsize

    def codec_spec(self, codec: CodecConfig) -> CodecSpec:
        """The `CodecSpec` of a tier that writes with `codec` in this store: it reads every
        lossless codec, its own, and the lossy ones the store's identity admits."""
        return CodecSpec(codec.kind, self.codec_dtype, self.codec_group, self.accepted_codecs, config=codec)


@dataclass(frozen=True)
class TierConfig(abc.ABC):
    """A tier's config: a frozen dataclass whose `__post_init__` validates its own fields
    (a bad one is a `ConfigError` naming it), registered with `register_tier`.

    `tier` is the class it opens; its `kind` and `traits` say what the tier is before any
    store opens one (metric labels, vLLM's hit sources).
    """

    tier: ClassVar[type[Tier]]

    @property
    def codec(self) -> CodecConfig | None:
        """The codec the tier writes blocks with (None: it holds raw blocks). A lossy codec
        enters the store's identity (`kvstore/codec_config.py`)."""
        return None

    def check(self, block_bytes: int, what: str) -> None:
        """Raise `ConfigError` (naming the field as `what`.field) if the tier cannot serve
        blocks of `block_bytes` (too small to hold one); changes nothing."""
        return None

    @abc.abstractmethod
    def open(self, ctx: TierContext) -> Tier:
        """A new tier of this config in a store of `ctx`. Raises `ConfigError` for a value
        only opening can check (a device that is absent, a directory that is not writable);
        nothing is left open then."""


TIERS: Registry[TierConfig] = Registry("tier", TierConfig, BUILTIN_TIERS)


def register_tier(name: str) -> Callable[[R], R]:
    """Class decorator: register a `TierConfig` subclass under `name` (its `tier` is what
    it makes, so a config may also name the tier by its class name)."""

    def add(config_cls: R) -> R:
        tier = getattr(config_cls, "tier", None)
        is_tier = isinstance(tier, type) and issubclass(tier, Tier)
        if not is_tier or not isinstance(getattr(tier, "kind", None), str) \
                or not isinstance(getattr(tier, "traits", None), TierTraits):
            raise ConfigError(f"the tier config {config_cls.__qualname__} must name the Tier subclass it opens, with "
                              f"its kind and traits, as `tier`; got {tier!r}")
        TIERS.add(name, config_cls, makes=tier)
        return config_cls

    return add


def tier_config(value: object, what: str = "tier") -> TierConfig:
    """`value` (a `TierConfig`, a registered name, or a dict with its `type`) as a config;
    `ConfigError` naming `what` otherwise."""
    return TIERS.config_from(value, what=what)
