"""Helpers of the shared tiers' tests (remote, Mooncake, shared filesystem): a prompt's
tokens, a store's shared tier, the KV events that announce its blocks."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from kvstore import KVCacheStore
from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv

T = TypeVar("T")


def prompt_tokens(n_blocks: int, seed: int) -> np.ndarray:
    """`n_blocks` full blocks of random token ids."""
    return np.random.default_rng(seed).integers(0, 50_000, size=n_blocks * BLOCK, dtype=np.uint32)


def last_tier(store: KVCacheStore, kind: type[T]) -> T:
    """The store's last tier (its shared one), asserted to be a `kind`."""
    tier = store.tiers[-1]
    assert isinstance(tier, kind)
    return tier


def shared_stored_events(store: KVCacheStore, reader: Any, tokens: np.ndarray) -> list[dict[str, Any]]:
    """Store `tokens` and wait until `reader` (`tests.kvstore.test_events.Reader`) holds each
    of their blocks as SHARED and CPU; the shared tier's `BlockStored` events (asserted some)."""
    from kvevents import wire_hash
    from tests.kvstore.test_events import held

    store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
    want = {wire_hash(h) for h in store.block_hashes(tokens)}
    reader.until(lambda events: want <= held(events)["SHARED"])
    assert want <= held(reader.events())["SHARED"] and want <= held(reader.events())["CPU"]
    stored = [e for e in reader.events() if e["type"] == "BlockStored" and e["medium"] == "SHARED"]
    assert stored
    return stored
