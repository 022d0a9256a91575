"""kvstrata: a tiered KV-cache store for LLM inference."""

from kvstore.config import HashAlgo, KVLayout, StoreConfig
from kvstore.engine_api import BlockChange, BlockEvent, BlockStore, EventBatch, LoadResult, LookupResult, SaveResult
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
from kvstore.prefetch import MAX_PREFETCH_BLOCKS, PrefetchResult, PrefetchStatus
from kvstore.priority import Priority, PriorityResult
from kvstore.results import ClearResult
from kvstore.store import CloseResult, KVCacheStore, RetrieveResult, StoreStats
from tiers.codecs import CodecKind
from tiers.disk.durability import DiskSync

__version__ = "0.1.0"

__all__ = [
    "MAX_PREFETCH_BLOCKS",
    "BlockChange",
    "BlockEvent",
    "BlockHash",
    "BlockStore",
    "ClearResult",
    "CloseResult",
    "CodecKind",
    "ConfigError",
    "CorruptRecordError",
    "DiskFullError",
    "DiskSync",
    "EventBatch",
    "ExtraKeys",
    "HashAlgo",
    "InvalidInputError",
    "InvalidTokensError",
    "KVCacheStore",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "LoadResult",
    "LookupResult",
    "MultiModalInput",
    "PrefetchResult",
    "PrefetchStatus",
    "Priority",
    "PriorityResult",
    "RetrieveResult",
    "SaveResult",
    "StoreClosedError",
    "StoreConfig",
    "StoreStats",
    "block_hashes",
    "namespace_seed",
]
