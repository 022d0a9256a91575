"""The publisher's mirror of what it announced, so a subscriber that lost the stream can be
given the whole state without touching the store (no store lock, no disk scan).

Per block: its full description (`BlockKey` with token ids, parent and extras) and the media
that hold it, as announced. A block reported by its hash alone is described from the mirror
(another medium holds it) or not at all (counted). Bounded: at most `max_blocks` blocks are
mirrored (past that, blocks are still announced live but left out of snapshots, counted).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.wire import BadPayload, vllm_extras
from tiers.keys import BlockKey


def is_described(key: BlockKey) -> bool:
    """Whether `key` can be announced: token ids, a parent, and extras that decode (a disk
    may hand back damaged ones)."""
    if not key.tokens or key.parent is None or key.extras is None:
        return False
    try:
        vllm_extras(key.extras)
    except BadPayload:
        return False
    return True


class Mirror:
    """Announced blocks by hash: `[key, media bits]`. Invariant: every entry has a medium bit
    set and a described key. Callers serialize access (the publisher's lock)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.blocks: dict[bytes, tuple[BlockKey, int]] = {}  # entries are replaced, never changed
        self.num_unmirrored = 0  # blocks announced live but beyond max_blocks
        self.num_undescribed = 0  # stored blocks nobody described: not announced

    def resolve(self, key: BlockKey) -> BlockKey | None:
        """`key` fully described, from itself or the mirror; None if unknown."""
        if is_described(key):
            return key
        entry = self.blocks.get(bytes(key.block_hash))
        return None if entry is None else entry[0]

    def stored(self, bit: int, key: BlockKey) -> BlockKey | None:
        """Record `key` as held in medium `bit`; its full description (None: unknown, not to
        be announced)."""
        full = self.resolve(key)
        if full is None:
            self.num_undescribed += 1
            return None
        h = bytes(key.block_hash)
        entry = self.blocks.get(h)
        if entry is not None:
            self.blocks[h] = (entry[0], entry[1] | bit)
        elif len(self.blocks) < self.max_blocks:
            self.blocks[h] = (full, bit)
        else:
            self.num_unmirrored += 1
        return full

    def removed(self, bit: int, block_hash: bytes) -> None:
        h = bytes(block_hash)
        entry = self.blocks.get(h)
        if entry is None:
            return
        if entry[1] & ~bit:
            self.blocks[h] = (entry[0], entry[1] & ~bit)
        else:
            del self.blocks[h]

    def cleared(self, bits: int) -> None:
        for h in [h for h, e in self.blocks.items() if e[1] & bits]:
            self.removed(bits, h)

    def restate(self, bit: int, keys: Iterable[BlockKey]) -> None:
        """Medium `bit` holds exactly `keys` now (each described from itself or the mirror,
        as it was before, else counted and left out)."""
        full = [self.resolve(k) for k in keys]
        self.num_undescribed += sum(1 for f in full if f is None)
        self.cleared(bit)
        for key in full:
            if key is not None:
                self.stored(bit, key)

    def copy(self) -> dict[bytes, tuple[BlockKey, int]]:
        """The mirrored blocks now (a shallow copy: one C-level pass, entries are immutable)."""
        return self.blocks.copy()


def root_first(blocks: dict[bytes, tuple[BlockKey, int]], seed: bytes) -> list[tuple[BlockKey, int]]:
    """Every block of `blocks` (a `Mirror.copy()`) reachable from a chain root (`seed` as
    parent), with its media bits, parents before children (depth first, so a chain's blocks
    are consecutive). Blocks whose parent is gone from every medium are left out: no prefix
    reaches them."""
    children: dict[bytes, list[bytes]] = {}
    for h, (key, _) in blocks.items():
        children.setdefault(bytes(key.parent or b""), []).append(h)
    out: list[tuple[BlockKey, int]] = []
    stack: list[bytes] = list(reversed(children.get(bytes(seed), [])))
    while stack:
        h = stack.pop()
        out.append(blocks[h])
        stack.extend(reversed(children.get(h, [])))
    return out
