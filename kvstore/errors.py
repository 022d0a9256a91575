"""The kvstrata exception hierarchy, rooted in one `KVStoreError`.

Invalid input raises a subclass that is also a `ValueError`; conditions of
the running store (closed, disk full) raise subclasses that are also
`RuntimeError`. A damaged record is never raised to callers of the store:
it is turned into a miss and deleted (`CorruptRecordError` is internal).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Root of every error kvstrata raises on purpose."""


class InvalidInputError(KVStoreError, ValueError):
    """An argument of a public call is malformed; nothing was changed."""


class InvalidTokensError(InvalidInputError):
    """Tokens are not a 1-D sequence of integers in [0, 2**32)."""


class LayoutMismatchError(InvalidInputError):
    """A KV tensor's shape, dtype or length does not match the store's layout."""


class ConfigError(InvalidInputError):
    """A configuration value is out of range or inconsistent."""


class StoreClosedError(KVStoreError, RuntimeError):
    """The store (or tier) was used after `close()`."""


class DiskFullError(KVStoreError, RuntimeError):
    """The disk tier cannot take a write even after eviction; the write was refused whole."""


class CorruptRecordError(KVStoreError):
    """A stored record failed validation (checksum, header, key or tokens).

    Tiers raise it internally; the store turns it into a miss and deletes the record.
    """
