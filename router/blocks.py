"""One source's blocks: its chain map (publisher block hash -> router key and tier bits) and
the index bits they set. Every call costs what it names (the hashes of an event), or what
the slot holds (`drop`), never a walk of the index.

A block is indexed under the router's own key (`router/keys.py`), computed from its parent's
key and its own token ids and extras; a block whose extra keys a `/lookup` cannot express
(multimodal inputs, prompt embeddings), or a salt off a sequence's first block, ends the
run: it and the blocks after it are left out (the caller counts them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from router.decode import Stored
from router.index import KVIndex
from router.keys import block_key, extras
from router.source import Slot


class Written(NamedTuple):
    """What `store` did with an event's blocks: indexed, and left out for the slot's bound."""

    done: int
    dropped: int


def store(index: KVIndex, slot: Slot, tier: int, event: Stored, parent: int, max_blocks: int) -> Written:
    """Index the blocks of `event` in `tier` of `slot`, the first one after the block keyed
    `parent`, until one cannot be (the rest are left out)."""
    bs, bit, lora = event.block_size, 1 << tier, event.lora_name
    buf = event.tokens.tobytes()
    for i, h in enumerate(event.hashes):
        first = event.parent is None and i == 0
        salt = salt_of(event.extra_keys[i] if event.extra_keys else None, lora, first)
        if salt is False:
            return Written(i, 0)
        entry = slot.chain.get(h)
        if entry is None and len(slot.chain) >= max_blocks:
            return Written(i, len(event.hashes) - i)
        key = block_key(parent, buf[i * bs * 4 : (i + 1) * bs * 4],
                        extras(salt if isinstance(salt, str) else None, lora, first))
        if entry is not None and entry[0] != key:  # the same hash for other tokens: trust the latest
            _forget_entry(index, slot, h, entry[0], entry[1])
            entry = None
        slot.chain[h] = (key, (entry[1] if entry is not None else 0) | bit)
        index.add(slot.index, tier, (key,))
        parent = key
    return Written(len(event.hashes), 0)


def remove(index: KVIndex, slot: Slot, tier: int, hashes: Iterable[int]) -> None:
    """`slot` no longer holds the blocks of `hashes` in `tier` (unknown ones are ignored)."""
    bit = 1 << tier
    for h in hashes:
        entry = slot.chain.get(h)
        if entry is not None and entry[1] & bit:
            index.remove(slot.index, tier, (entry[0],))
            if entry[1] & ~bit:
                slot.chain[h] = (entry[0], entry[1] & ~bit)
            else:
                del slot.chain[h]


def drop(index: KVIndex, slot: Slot, tiers: int) -> None:
    """Forget what `slot` holds in `tiers` (a mask). O(what the slot holds)."""
    chain, n = slot.chain, slot.index
    if tiers == 0xF:
        for tier in range(4):
            index.remove(n, tier, [key for key, bits in chain.values() if bits >> tier & 1])
        chain.clear()
        return
    for h, (key, bits) in list(chain.items()):
        if bits & tiers:
            _forget_entry(index, slot, h, key, bits & tiers)
            if bits & ~tiers:
                chain[h] = (key, bits & ~tiers)


def _forget_entry(index: KVIndex, slot: Slot, h: int, key: int, bits: int) -> None:
    """Clear `bits` of the chain entry `h` (keyed `key`) from the index, and the entry."""
    for tier in range(4):
        if bits >> tier & 1:
            index.remove(slot.index, tier, (key,))
    slot.chain.pop(h, None)


def salt_of(entry: object, lora: str | None, first: bool) -> str | bool | None:
    """The cache salt of a block's vLLM `extra_keys` entry (None: none); False if the entry
    holds what a `/lookup` cannot express, or a salt off a sequence's first block."""
    items = list(entry) if isinstance(entry, list) else []
    if lora is not None and items and items[0] == lora:
        items = items[1:]
    if not items:
        return None
    if len(items) == 1 and isinstance(items[0], str) and first:
        return items[0]
    return False
