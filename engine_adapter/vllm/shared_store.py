"""One `KVCacheStore` per configuration per process, shared by reference count.

An engine's scheduler-side and worker-side connector objects may live in one process;
sharing the store gives both the same CPU tier (and LMDB allows one environment per file per
process anyway). Each process has its own registry: a forked child never sees the parent's.
"""

from __future__ import annotations

import os
import threading

from kvstore import KVCacheStore, StoreConfig

_LOCK = threading.Lock()
_STORES: dict[tuple[int, StoreConfig], list] = {}  # (pid, config) -> [store, refcount]


def acquire_store(config: StoreConfig) -> KVCacheStore:
    """The process's store for `config`, opened on first use; pair with `release_store`."""
    key = (os.getpid(), config)
    with _LOCK:
        entry = _STORES.get(key)
        if entry is None:
            entry = _STORES[key] = [KVCacheStore(config), 0]
        entry[1] += 1
        return entry[0]


def find_store(config: StoreConfig) -> KVCacheStore | None:
    """The process's open store for `config`, if any; takes no reference."""
    with _LOCK:
        entry = _STORES.get((os.getpid(), config))
        return None if entry is None else entry[0]


def release_store(config: StoreConfig) -> None:
    """Drop one reference; the last one closes the store (flushing the CPU tier to disk)."""
    with _LOCK:
        key = (os.getpid(), config)
        entry = _STORES.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _STORES[key]
    entry[0].close()
