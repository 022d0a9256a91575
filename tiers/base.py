"""The one narrow protocol every tier implements (pool, CPU, disk).

A tier holds whole blocks, each a tensor `[num_layers, 2, block_size, num_kv_heads, head_dim]`
of the layout's dtype, keyed by `BlockHash`. Sequences of blocks passed to `put` and `touch`
are in *eviction order*: the first entry is the first to be evicted. Callers storing a
sequence pass it tail first, so a sequence's tail leaves a tier before its prefix (a block
is useless once its parent is gone). `get_into` takes keys in prefix order. What enters and
leaves a tier is recorded in the tier's change log (`tiers/changes.py`) for the stack to take.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch

from tiers.changes import ChangeKind, ChangeLog, TierChange
from tiers.keys import BlockHash, BlockKey, TierKind


@dataclass(frozen=True)
class TierTraits:
    """What a tier is, declared by the tier itself; the stack, the store, events, metrics
    and engines decide behaviour from these, never from the tier's kind or class.

    Attributes:
        engine_memory: the blocks are the paged KV an engine attends over (the block pool):
            a hit there costs no copy.
        memory: held in RAM or device memory (fast; gone when the process ends).
        persistent: survives a restart of the process (a disk).
        shared: other processes and hosts read and write it (a server): every stored block
            is written to it at once, and its listing is slow.
    """

    engine_memory: bool = False
    memory: bool = False
    persistent: bool = False
    shared: bool = False


def plan_put(keys: Sequence[BlockKey], is_held: Callable[[BlockHash], bool], room: int) -> tuple[list[int], list[int]]:
    """Split a `put` (keys in eviction order) into (overflow, fit): indices of the blocks to
    write, those not held, the last of duplicates winning; `fit` is at most the `room` least
    evictable of them, `overflow` the rest, which skip the tier for the one below."""
    seen: set[BlockHash] = set()
    new: list[int] = []
    for i in range(len(keys) - 1, -1, -1):
        h = keys[i].block_hash
        if h not in seen and not is_held(h):
            seen.add(h)
            new.append(i)
    new.reverse()
    cut = max(0, len(new) - max(0, room))
    return new[:cut], new[cut:]


@dataclass
class TierCounters:
    """Counters every tier keeps (since it opened)."""

    num_hits: int = 0
    num_puts: int = 0
    num_evictions: int = 0
    num_corrupt: int = 0


class Occupancy(NamedTuple):
    """How full a tier is now."""

    num_blocks: int
    capacity_blocks: int
    used_bytes: int
    capacity_bytes: int


def check_start(start: int) -> None:
    """Refuse a negative prefix offset (it would count from the prompt's end)."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")


def count_held(index: object, block_hashes: Sequence[BlockHash], start: int) -> int:
    """Consecutive `block_hashes[start:]` found in `index` (anything with `in`)."""
    check_start(start)
    n, end = start, len(block_hashes)
    while n < end and block_hashes[n] in index:  # type: ignore[operator]  # a dict or set
        n += 1
    return n - start


class ScrubResult(NamedTuple):
    """What `Tier.scrub` found: blocks of this namespace that validated, damaged ones it
    deleted, and blocks of other namespaces sharing the tier (left alone)."""

    num_ok: int
    num_corrupt: int
    num_foreign: int = 0


class SweepResult(NamedTuple):
    """What a clear deleted (keys a tier counts, else 0); `complete` False: some may be left."""

    num_deleted: int
    complete: bool


@dataclass(frozen=True)
class TenantStats:
    """A snapshot of one tenant's share of a tier, under its hashed label."""

    label: str
    num_blocks: int
    quota_blocks: int
    num_hits: int
    num_puts: int
    num_evictions: int


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier's occupancy and counters (`tenants`: per-tenant shares)."""

    kind: TierKind
    num_blocks: int
    capacity_blocks: int
    used_bytes: int
    capacity_bytes: int
    num_hits: int
    num_puts: int
    num_evictions: int
    num_corrupt: int
    num_errors: int = 0
    num_write_drops: int = 0
    tenants: tuple[TenantStats, ...] = ()


class Below(Protocol):
    """What a tier sees of the tiers below it, given by the store's tier stack (a tier never
    holds another tier): where its evicted, overflowing or spilled blocks go."""

    def demote(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Store the blocks (eviction order) one tier down; return how many it wrote. Raises
        `DiskFullError` (nothing written) if that tier cannot make room."""
        ...

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether the tier below already holds the block."""
        ...


_T = TypeVar("_T", bound="Tier")


class Tier(abc.ABC):
    """A store of fixed-size KV blocks with LRU eviction.

    Invariant: every held block is bit-exact with what was put under its hash; a block
    that fails validation is deleted and reported as absent, never returned. Every block
    that enters or leaves the tier is recorded, in order, in its change log (`take_changes`):
    a tier tells no one, holds no callback and never calls up.
    """

    kind: ClassVar[TierKind]
    traits: ClassVar[TierTraits]
    below: Below | None = None  # set by the tier stack; None: evicted blocks are dropped
    counters: TierCounters  # each tier sets its own in __init__
    num_spill_refused: int = 0  # blocks a full tier below refused during spills
    num_write_drops: int = 0  # writes a tier that writes in the background gave up (counted, warned)
    _changes: ChangeLog  # set for every tier at construction (`__new__`)

    def __new__(cls: type[_T], *args: Any, **kwargs: Any) -> _T:
        tier = super().__new__(cls)
        tier._changes = ChangeLog()  # every tier has one, whatever its __init__ does
        return tier

    def take_changes(self) -> list[TierChange]:
        """The blocks that entered and left this tier since the last call, oldest first; forgets
        them. The first call starts the recording (and returns nothing). After an overflow
        (`tiers/changes.py`) the first change is a `RESYNC` with the keys the tier holds now
        (`held_keys`, where it keeps keys and is open). Safe from any thread."""
        return self._changes.take(self.kind, self.held_keys)

    @property
    def num_changes_dropped(self) -> int:
        """Blocks whose changes were dropped because nobody took them (see `take_changes`)."""
        return self._changes.num_dropped

    def _record(self, kind: ChangeKind, blocks: Sequence[BlockKey | BlockHash]) -> None:
        """Record that `blocks` (keys or bare hashes) entered or left this tier; never raises."""
        if blocks:
            self._changes.record(TierChange(self.kind, kind, [b if isinstance(b, BlockKey) else BlockKey(b)
                                                              for b in blocks]))

    @property
    def num_errors(self) -> int:
        """Faults of the tier's medium (a server) turned into misses or dropped writes."""
        return 0

    def held_hashes(self) -> Iterator[BlockHash]:
        """Every block this tier holds now, in no particular order (for KV-event snapshots).
        A tier that cannot enumerate its blocks yields nothing. Changes nothing."""
        return iter(())

    def held_keys(self) -> Iterator[BlockKey]:
        """The keys of the blocks this tier holds with what it kept of them (token ids,
        parent, extras): a persistent tier's announce a warm tier after a restart, every
        tier's restate its contents after its change log overflowed. Tiers that keep no keys
        yield nothing. Changes nothing."""
        return iter(())

    @property
    @abc.abstractmethod
    def capacity_blocks(self) -> int:
        """Upper bound on the number of blocks held (an estimate for byte-bounded tiers)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of blocks held now."""

    @abc.abstractmethod
    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        """Count the consecutive `block_hashes[start:]` this tier holds. Changes nothing."""

    def get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        """Copy the blocks of `keys` (prefix order) into `dsts`; return how many were copied.

        Stops at the first block that is absent or fails validation (the latter is deleted).
        `dsts` are block-shaped tensors of the layout's dtype on any device, possibly
        strided; those past the count returned may have been written (a shared tier receives
        a value in place before checking it): their bytes are undefined. Copied blocks become
        most recently used, prefix last. 0 for []. Raises `RuntimeError` if `_get_into`
        counts outside 0..len(keys) (a bug in the tier: taken at its word, the caller would
        skip blocks never copied).
        """
        self._check_open()
        n = self._get_into(keys, dsts)
        if not 0 <= n <= len(keys):
            raise RuntimeError(f"{type(self).__name__} copied {n} of the {len(keys)} blocks asked (a bug in the tier)")
        self.counters.num_hits += n
        self.touch([k.block_hash for k in reversed(keys[:n])])
        return n

    def put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Store blocks not already held; return how many were written.

        `keys`/`srcs` are in eviction order. Blocks already held are only touched. Room is
        made by evicting least recently used blocks (demoted through `below` where the stack
        gave one). Raises `DiskFullError` if the write cannot be made; then nothing of this
        call was stored.
        """
        self._check_open()
        if len(keys) != len(srcs):
            raise ValueError(f"put got {len(keys)} keys but {len(srcs)} tensors")
        written = self._put(keys, srcs)
        self.counters.num_puts += written
        return written

    @abc.abstractmethod
    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        """`get_into` without the bookkeeping (open check, hit count, recency)."""

    @abc.abstractmethod
    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """`put` of validated arguments on an open tier; returns how many it wrote."""

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise `StoreClosedError` if the tier was closed."""

    @abc.abstractmethod
    def occupancy(self) -> Occupancy:
        """How full the tier is; changes nothing."""

    def stats(self) -> TierStats:
        """Occupancy and counters; changes nothing."""
        occupancy = self.occupancy()
        c = self.counters
        return TierStats(self.kind, *occupancy, num_hits=c.num_hits, num_puts=c.num_puts,
                         num_evictions=c.num_evictions, num_corrupt=c.num_corrupt, num_errors=self.num_errors,
                         num_write_drops=self.num_write_drops, tenants=tuple(self.tenant_stats()))

    def tenant_stats(self) -> list[TenantStats]:
        """Per-tenant blocks and counters under hashed labels (empty: the tier keeps no quotas)."""
        return []

    @abc.abstractmethod
    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Mark held blocks (eviction order) most recently used; absent ones are ignored."""

    @abc.abstractmethod
    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        """Delete the given blocks if held (no demotion); return how many were deleted."""

    def spill(self) -> int:
        """Copy held blocks down to the next tier (kept here too); return how many it wrote.

        0 for a tier with nothing below it. Used to persist on shutdown.
        """
        return 0

    def flush(self) -> bool:
        """Wait until writes this tier queued are done (True), or its time limit passed
        (False). Tiers that write synchronously have nothing to wait for."""
        return True

    def deprioritize(self, block_hashes: Sequence[BlockHash]) -> int:
        """Make held blocks the next to evict (a low-priority request's), the last given
        first; return how many were moved. A tier that orders no eviction of its own (a
        shared server's, the disk's index order) moves none (returns 0)."""
        return 0

    def pin(self, block_hashes: Sequence[BlockHash]) -> int:
        """Protect the leading held blocks from eviction until `unpin`; return how many were
        pinned. A tier that never evicts under a reader pins nothing (returns 0)."""
        return 0

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Undo `pin` for the given blocks; blocks deleted meanwhile are skipped."""
        return None

    @abc.abstractmethod
    def clear(self, *, all_namespaces: bool = False) -> None:
        """Delete every block of this store's namespace. A tier several namespaces share (a
        disk directory, a server) deletes, with `all_namespaces`, every block kvstrata wrote
        there, whoever wrote it; other tiers hold one namespace and ignore the flag."""

    def sweep(self, *, all_namespaces: bool = False) -> SweepResult:
        """`clear`, saying how it went (a tier whose clear can stop short overrides it)."""
        self.clear(all_namespaces=all_namespaces)
        return SweepResult(0, True)

    def scrub(self) -> ScrubResult | None:
        """Validate every block held; delete the damaged ones. None for a tier that keeps no
        checks to run (memory tiers)."""
        return None

    @property
    def identity(self) -> str | None:
        """Where other processes reach this tier's blocks (a shared tier's server, without
        credentials), so routers can tell which instances share them; None otherwise."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release memory and files. Idempotent; later calls raise `StoreClosedError`."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise `RuntimeError` (a bug) if an internal invariant does not hold."""


