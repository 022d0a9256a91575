"""kvstrata: a tiered KV-cache store for LLM inference."""

from kvstore.config import HashAlgo, KVLayout, StoreConfig
from kvstore.errors import (
    ConfigError,
    CorruptRecordError,
    DiskFullError,
    InvalidInputError,
    InvalidTokensError,
    KVStoreError,
    LayoutMismatchError,
    StoreClosedError,
)
from kvstore.hashing import BlockHash, ExtraKeys, MultiModalInput, block_hashes, namespace_seed
from kvstore.results import ClearResult
from kvstore.store import CloseResult, KVCacheStore, LoadResult, RetrieveResult, StoreStats
from tiers.codecs import CodecKind
from tiers.disk_durability import DiskSync

__version__ = "0.1.0"

__all__ = [
    "BlockHash",
    "ClearResult",
    "CloseResult",
    "CodecKind",
    "ConfigError",
    "CorruptRecordError",
    "DiskFullError",
    "DiskSync",
    "ExtraKeys",
    "HashAlgo",
    "InvalidInputError",
    "InvalidTokensError",
    "KVCacheStore",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "LoadResult",
    "MultiModalInput",
    "RetrieveResult",
    "StoreClosedError",
    "StoreConfig",
    "StoreStats",
    "block_hashes",
    "namespace_seed",
]
