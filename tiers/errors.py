"""The error types of the storage tiers; `kvstore.errors` builds the public hierarchy on them.

One root, `KVStoreError`, for everything kvstrata raises on purpose. Invalid input raises a
subclass that is also a `ValueError`; conditions of a running store or tier (closed, disk
full) raise subclasses that are also `RuntimeError`. A damaged record is never raised to
callers of the store: it is turned into a miss and deleted (`CorruptRecordError` is internal).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Root of every error kvstrata raises on purpose."""


class InvalidInputError(KVStoreError, ValueError):
    """An argument of a public call is malformed; nothing was changed."""


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


class UnverifiableRecordError(CorruptRecordError):
    """A sound record this reader cannot check or decode (no token ids, a codec it does not
    know, cannot load or does not accept): a miss, not deleted."""
