"""The kvstrata exception hierarchy, rooted in one `KVStoreError`.

The root and the conditions storage media raise (closed, disk full, a damaged record, a bad
tier size) come from `tiers.errors`; this module adds the errors of the store's inputs.
Invalid input raises a subclass that is also a `ValueError`; conditions of the running store
raise subclasses that are also `RuntimeError`. A damaged record is never raised to callers
of the store: it is turned into a miss and deleted (`CorruptRecordError` is internal).
"""

from __future__ import annotations

from tiers.errors import (
    ConfigError,
    CorruptRecordError,
    DiskFullError,
    InvalidInputError,
    KVStoreError,
    StoreClosedError,
)

__all__ = [
    "ConfigError",
    "CorruptRecordError",
    "DiskFullError",
    "InvalidInputError",
    "InvalidTokensError",
    "KVStoreError",
    "LayoutMismatchError",
    "StoreClosedError",
]


class InvalidTokensError(InvalidInputError):
    """Tokens are not a 1-D sequence of integers in [0, 2**32)."""


class LayoutMismatchError(InvalidInputError):
    """A KV tensor's shape, dtype or length does not match the store's layout."""
