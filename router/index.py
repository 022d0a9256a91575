"""The block index: which slot (one event source, or a shared remote tier) holds which block
in which tier. Pure data, no I/O; one event loop owns it.

One dict maps a block key (`router/keys.py`: 64 bits, enough to tell blocks apart for
routing, which never returns KV) to a bitmask with 4 bits per slot, one per tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

TIERS = ("pool", "cpu", "disk", "remote")
TIER_BIT = {name: i for i, name in enumerate(TIERS)}
REMOTE = TIER_BIT["remote"]
_ALL = 0xF


class KVIndex:
    """Block key -> 4 tier bits per slot.

    Invariant: no entry has the value 0 (a block no slot holds is absent).
    """

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, slot: int, tier: int, keys: Iterable[int]) -> None:
        """Record that `slot` holds `keys` in `tier`."""
        bit = 1 << (4 * slot + tier)
        blocks = self._blocks
        get = blocks.get
        for key in keys:
            blocks[key] = get(key, 0) | bit

    def remove(self, slot: int, tier: int, keys: Iterable[int]) -> None:
        """Record that `slot` no longer holds `keys` in `tier` (absent keys are ignored)."""
        bit = 1 << (4 * slot + tier)
        blocks = self._blocks
        for key in keys:
            value = blocks.get(key)
            if value is not None and value & bit:
                value &= ~bit
                if value:
                    blocks[key] = value
                else:
                    del blocks[key]

    def clear(self, slot: int, tier: int | None = None) -> None:
        """Forget every block of `slot` (in one tier, or in all). O(blocks indexed)."""
        mask = (_ALL if tier is None else 1 << tier) << (4 * slot)
        blocks = self._blocks
        for key in [k for k, v in blocks.items() if v & mask]:
            value = blocks[key] & ~mask
            if value:
                blocks[key] = value
            else:
                del blocks[key]

    def count(self, slot: int, tier: int) -> int:
        """Blocks `slot` holds in `tier`. O(blocks indexed)."""
        bit = 1 << (4 * slot + tier)
        return sum(1 for v in self._blocks.values() if v & bit)

    def match(self, keys: Sequence[int], groups: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]]:
        """For each group of `(slot, tier mask)` (the slots one instance reads: its sources,
        each with all 4 tiers, and the shared remote tiers it reads, with the remote bit):
        how many blocks of the longest prefix of `keys` the group holds, each counted in
        the fastest tier holding it, as `[pool, cpu, disk, remote]`. Changes nothing."""
        values: list[int] = []
        get = self._blocks.get
        for key in keys:
            value = get(key, 0)
            if not value:
                break
            values.append(value)
        out: list[list[int]] = []
        for group in groups:
            counts = [0, 0, 0, 0]
            for value in values:
                bits = 0
                for slot, mask in group:
                    bits |= (value >> (4 * slot)) & mask
                if not bits:
                    break
                counts[(bits & -bits).bit_length() - 1] += 1  # the fastest tier holding it
            out.append(counts)
        return out
