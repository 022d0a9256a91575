"""One `KVCacheStore` per configuration per process, shared by reference count.

An engine's scheduler-side and worker-side connector objects may live in one process;
sharing the store gives both the same CPU tier (and LMDB allows one environment per file per
process anyway). Each process has its own registry: a forked child never sees the parent's.
"""

from __future__ import annotations

from kvstore import KVCacheStore, StoreConfig
from tiers.shared.process_objects import ProcessRegistry

_STORES: ProcessRegistry[StoreConfig, KVCacheStore] = ProcessRegistry()


def acquire_store(config: StoreConfig) -> KVCacheStore:
    """The process's store for `config`, opened on first use; pair with `release_store`."""
    return _STORES.acquire(config, lambda: KVCacheStore(config))


def find_store(config: StoreConfig) -> KVCacheStore | None:
    """The process's open store for `config`, if any; takes no reference."""
    return _STORES.find(config)


def release_store(config: StoreConfig) -> None:
    """Drop one reference; the last one closes the store (flushing the CPU tier to disk)."""
    _STORES.release(config, lambda store: store.close())
