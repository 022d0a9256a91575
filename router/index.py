"""The block index: which slot (one event source, or a shared remote tier) holds which block
in which tier. Pure data, no I/O; one event loop owns it.

One dict maps a block key (`router/keys.py`: 64 bits, enough to tell blocks apart for
routing, which never returns KV) to a bitmask with 4 bits per slot, one per tier. Every
change costs what it names: the keys given. Forgetting a slot's blocks takes the keys from
the slot's own chain map (`router/fleet.py`), never a scan of the index, so one source's
restart costs what that source holds, whatever the others hold. Per slot and tier the index
keeps how many blocks it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

TIERS = ("pool", "cpu", "disk", "remote")
TIER_BIT = {name: i for i, name in enumerate(TIERS)}
REMOTE = TIER_BIT["remote"]
_NONE = (0, 0, 0, 0)


def tier_masks(slots: Iterable[tuple[int, int]]) -> tuple[int, int, int, int]:
    """The index bits that count in each tier for a group of `(slot, tier mask)`."""
    masks = [0, 0, 0, 0]
    for slot, tiers in slots:
        for tier in range(4):
            if tiers >> tier & 1:
                masks[tier] |= 1 << (4 * slot + tier)
    return masks[0], masks[1], masks[2], masks[3]


class KVIndex:
    """Block key -> 4 tier bits per slot.

    Invariant: no entry has the value 0 (a block no slot holds is absent), and
    `count(slot, tier)` is the number of entries with that slot's tier bit.
    """

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}
        self._counts: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, slot: int, tier: int, keys: Iterable[int]) -> None:
        """Record that `slot` holds `keys` in `tier`. O(len(keys))."""
        bit = 1 << (4 * slot + tier)
        blocks = self._blocks
        get = blocks.get
        added = 0
        for key in keys:
            value = get(key, 0)
            if not value & bit:
                blocks[key] = value | bit
                added += 1
        if added:
            self._counts.setdefault(slot, [0, 0, 0, 0])[tier] += added

    def remove(self, slot: int, tier: int, keys: Iterable[int]) -> None:
        """Record that `slot` no longer holds `keys` in `tier` (absent keys are ignored).
        O(len(keys))."""
        bit = 1 << (4 * slot + tier)
        blocks = self._blocks
        removed = 0
        for key in keys:
            value = blocks.get(key)
            if value is not None and value & bit:
                removed += 1
                value &= ~bit
                if value:
                    blocks[key] = value
                else:
                    del blocks[key]
        if removed:
            counts = self._counts[slot]
            counts[tier] -= removed
            if not any(counts):
                del self._counts[slot]

    def count(self, slot: int, tier: int) -> int:
        """Blocks `slot` holds in `tier`. O(1)."""
        return self._counts.get(slot, _NONE)[tier]

    def match(self, keys: Sequence[int], groups: Sequence[tuple[int, int, int, int]]) -> list[list[int]]:
        """For each group, given as the index bits that count for it in each tier
        (`tier_masks` of the slots one instance reads: its sources with all 4 tiers, and the
        shared remote tiers it reads with the remote one): how many blocks of the longest
        prefix of `keys` the group holds, each counted in the fastest tier holding it, as
        `[pool, cpu, disk, remote]`. Changes nothing."""
        values: list[int] = []
        get = self._blocks.get
        for key in keys:
            value = get(key, 0)
            if not value:
                break
            values.append(value)
        out: list[list[int]] = []
        for m0, m1, m2, m3 in groups:
            counts = [0, 0, 0, 0]
            for value in values:
                if value & m0:
                    counts[0] += 1
                elif value & m1:
                    counts[1] += 1
                elif value & m2:
                    counts[2] += 1
                elif value & m3:
                    counts[3] += 1
                else:
                    break
            out.append(counts)
        return out
