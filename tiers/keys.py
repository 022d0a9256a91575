"""The words every tier and every change speaks: a block's hash, its key, a tier's kind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, NamedTuple, NewType

BlockHash = NewType("BlockHash", bytes)
"""Opaque key of one block (to the store: a digest of the block with its whole prefix)."""


class _KindMeta(type):
    """Iterating `TierKind` yields the built-in kinds, fastest first."""

    def __iter__(cls) -> Iterator[TierKind]:
        return iter(_BUILTIN_KINDS)


class TierKind(str, metaclass=_KindMeta):
    """A tier's name: which tier served a block, the label in stats, metrics and events.

    An open set: a tier declares its own (`TierKind("name")`), so a new tier needs no edit
    here. Instances are interned (`TierKind("cpu") is TierKind.CPU`). What a tier *does* is
    never read from its kind: it is in its `traits`.
    """

    POOL: ClassVar[TierKind]
    CPU: ClassVar[TierKind]
    DISK: ClassVar[TierKind]
    REMOTE: ClassVar[TierKind]
    _interned: ClassVar[dict[str, TierKind]] = {}

    def __new__(cls, name: str) -> TierKind:
        known = cls._interned.get(name)
        if known is not None:
            return known
        if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
            raise ValueError(f"a tier kind is a lower-case identifier, got {name!r}")
        kind = cls._interned[name] = super().__new__(cls, name)
        return kind

    @property
    def value(self) -> str:
        """The plain name (as an enum's `value`)."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"TierKind({self.value!r})"


TierKind.POOL = TierKind("pool")
TierKind.CPU = TierKind("cpu")
TierKind.DISK = TierKind("disk")
TierKind.REMOTE = TierKind("remote")
_BUILTIN_KINDS = (TierKind.POOL, TierKind.CPU, TierKind.DISK, TierKind.REMOTE)


class BlockKey(NamedTuple):
    """A block's hash and, when token verification is on, its token ids (LE uint32 bytes).

    `parent` (the hash of the block before it, or the namespace seed for a first block) and
    `extras` (the canonical encoding of what besides tokens entered its hash; b"" for
    nothing) describe the block to KV-event readers and link it to its prefix; None means
    not known. `tenant` names who stored it for quotas (a digest of the namespace and cache
    salt; b"" for none). Tiers never use these to find a block.
    """

    block_hash: BlockHash
    tokens: bytes = b""
    parent: bytes | None = None
    extras: bytes | None = None
    tenant: bytes = b""
