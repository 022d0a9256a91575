"""CPU tier: a preallocated slab of block slots in host memory (pinned when CUDA is present)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import xxhash

from tiers.base import Occupancy, TenantStats, Tier, TierCounters, TierTraits, count_held, plan_put
from tiers.changes import ChangeKind
from tiers.cpu.residency import Residency, key_parent, key_tenant
from tiers.errors import ConfigError, DiskFullError, StoreClosedError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.policies.admission import Admission, AdmissionKind, AdmissionRule, parse_admission
from tiers.policies.eviction import EvictionConfig, EvictionKind
from tiers.shared.blockbatch import BlockBatch, copy_rows
from tiers.shared.blockcopy import copy_block, host_memory_bytes, mapped_tensor

_SPILL_CHUNK = 64  # blocks per lower-tier write when spilling


class CPUTier(Tier):
    """Fixed slots of `block_bytes` each, an index from hash to slot, and a `Residency` that
    orders the blocks for eviction (`eviction`: LRU by default), keeps pins, prefix links and,
    with `tenant_quota_blocks`, a quota per tenant.

    Invariant: every slot is either free or holds exactly one indexed block and its whole key
    as put (token ids, parent, extras, tenant), and the indexed blocks are exactly the
    residency's. Evicted blocks are demoted through `below` (if the stack gave one), whole keys
    and all, before their slot is reused, those `demote_admission` admits (`all`, or `seen:N`:
    used N times while here); the others are dropped, a write the tier below is spared. With
    `checksum`, each slot's xxh3-64 is taken when it is written and checked before it is read
    or demoted: a slot damaged in memory is then a miss and is dropped, never returned nor
    copied down.
    """

    kind = TierKind.CPU
    traits = TierTraits(memory=True)

    def __init__(
        self,
        num_slots: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        verify_tokens: bool = True,
        pin_memory: bool | None = None,
        checksum: bool = False,
        eviction: EvictionConfig | EvictionKind | str = EvictionKind.LRU,
        demote_admission: AdmissionRule | str = "all",
        tenant_quota_blocks: int | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"CPUTier needs at least one slot, got {num_slots}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        num_bytes = num_slots * math.prod(block_shape) * dtype.itemsize
        if num_bytes > host_memory_bytes():  # refuse before zero-filling into an OOM kill
            raise ConfigError(f"CPU tier of {num_bytes} bytes exceeds this machine's RAM ({host_memory_bytes()})")
        try:
            shape = (num_slots, *block_shape)  # a mapping of its own: close() returns it to the OS
            self._slab = torch.empty(shape, dtype=dtype, pin_memory=True) if pin_memory else mapped_tensor(shape, dtype)
            self._slab.view(torch.uint8).zero_()  # fault every page in now, not on the hot path
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(f"CPU tier of {num_bytes} bytes cannot be allocated: {exc}") from None
        self._num_slots = num_slots
        self._block_bytes = self._slab[0].numel() * self._slab.element_size()
        self._verify_tokens = verify_tokens
        self._index: dict[BlockHash, int] = {}
        self._res: Residency[BlockHash] = Residency(num_slots, eviction, quota_blocks=tenant_quota_blocks)
        spec = parse_admission(demote_admission, "demote_admission")
        if spec.kind is AdmissionKind.TINYLFU:  # it needs the lower tier's victim, unknown here
            raise ConfigError("demote_admission must be 'all' or 'seen:N'; 'tinylfu' needs the lower tier's victim")
        self._admission = Admission(spec, max(1024, 4 * num_slots))
        if self._admission.sketch is not None:
            self._res.on_use.append(self._admission.sketch)
        self._slot_keys: list[BlockKey | None] = [None] * num_slots  # each held block's key, as put
        self._checksum = checksum
        self._slot_sums: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._closed = False
        self.counters = TierCounters()
        self.num_spill_refused = 0  # blocks a full lower tier refused during spills

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self._num_slots

    @property
    def num_free_slots(self) -> int:
        """Slots holding no block."""
        return len(self._free)

    @property
    def slab(self) -> torch.Tensor:
        """The tier's memory, `[num_slots, *block_shape]` (inspect it; writing it damages blocks)."""
        return self._slab

    @property
    def is_pinned_memory(self) -> bool:
        return self._slab.is_pinned()

    def __len__(self) -> int:
        return len(self._index)

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        return count_held(self._index, block_hashes, start)

    def held_hashes(self) -> Iterator[BlockHash]:
        return iter(list(self._index))

    def held_keys(self) -> Iterator[BlockKey]:
        return iter([k for k in list(self._slot_keys) if k is not None])

    @property
    def eviction(self) -> EvictionConfig:
        return self._res.eviction

    @property
    def num_demotions_refused(self) -> int:
        """Evicted blocks not demoted because `demote_admission` refused them (writes saved)."""
        return self._admission.num_refused

    @property
    def num_pinned(self) -> int:
        """Blocks pinned now (each counted once, whatever its pin count)."""
        return len(self._res) - self._res.num_evictable

    @property
    def num_stranded(self) -> int:
        """Prefix blocks evicted while blocks linked to them were still held."""
        return self._res.num_stranded

    def tenant_stats(self) -> list[TenantStats]:
        """Per-tenant blocks and counters under hashed labels (empty without quotas)."""
        return self._res.tenant_stats()

    @property
    def num_tenants_tracked(self) -> int:
        """Tenants whose eviction policy and counters the tier keeps: those holding blocks now
        (0 without quotas). A tenant whose last block leaves is forgotten."""
        return self._res.num_tenants_tracked

    def block_view(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The slot tensor holding `block_hash` (a view: valid until the block is evicted)."""
        slot = self._index.get(block_hash)
        return None if slot is None else self._slab[slot]

    # -- data movement ---------------------------------------------------------------------
    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        n = 0
        slots: list[int] = []
        for key in keys[: len(dsts)]:
            slot = self._index.get(key.block_hash)
            if slot is None:
                break
            if (self._verify_tokens and key.tokens and self._key_at(slot).tokens != key.tokens) or (
                    self._checksum and self._sum(slot) != self._slot_sums[slot]):
                self.counters.num_corrupt += 1
                self._drop(key.block_hash)
                break
            slots.append(slot)
            n += 1
        if not (isinstance(dsts, BlockBatch) and copy_rows(dsts.rows, dsts.row_ids[:n], self._slab, slots)):
            self._copy_in(dsts[:n], [self._slab[s] for s in slots])
        if self._res.has_tenants:
            self._res.count_hits([k.block_hash for k in keys[:n]])
        return n

    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        res = self._res
        hashes = [k.block_hash for k in keys]
        res.touch(hashes)  # held blocks: a use, and not this put's victims
        overflow, new = plan_put(keys, self._index.__contains__, len(self._free) + res.num_evictable)
        if overflow:  # more new blocks than this tier can ever hold: the most evictable skip it
            self._send_down([keys[i] for i in overflow], [srcs[i] for i in overflow])
        if new and len(new) > len(self._free):
            self._make_room(len(new) - len(self._free), key_tenant(keys[new[0]]))
        slots = [self._free.pop() for _ in new]
        try:
            if not (isinstance(srcs, BlockBatch)
                    and copy_rows(self._slab, slots, srcs.rows, [srcs.row_ids[i] for i in new])):
                self._copy_in([self._slab[s] for s in slots], [srcs[i] for i in new])
        except BaseException:
            self._free.extend(reversed(slots))  # a failed copy takes no slot
            raise
        for slot, i in zip(slots, new):
            key = keys[i]
            self._slot_keys[slot] = key
            if self._checksum:
                self._slot_sums[slot] = self._sum(slot)
            self._index[key.block_hash] = slot
        if new:
            parents = [key_parent(keys[i]) for i in new]
            tenants = [key_tenant(keys[i]) for i in new]
            res.add_many([hashes[i] for i in new], parents if any(parents) else None,
                         tenants if any(tenants) else None)
            res.touch(hashes[new[-1] + 1:])  # the held prefix: more recent than its new tail
        res.end_put()
        self._record(ChangeKind.ENTERED, [keys[i] for i in new])
        return len(new)

    def _send_down(self, keys: list[BlockKey], srcs: list[torch.Tensor]) -> None:
        """Demote the blocks `demote_admission` admits (eviction order); drop the others.
        Raises `DiskFullError` (nothing written) if the tier below cannot make room."""
        below = self.below
        if below is None:
            return
        admission = self._admission
        if not admission.admits_all:
            ok = [i for i, k in enumerate(keys) if admission.admit(k.block_hash)]
            keys, srcs = [keys[i] for i in ok], [srcs[i] for i in ok]
        if keys:
            below.demote(keys, srcs)

    @staticmethod
    def _copy_in(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Copy `srcs[i]` into `dsts[i]`. Copies between the pinned slab and a GPU are queued
        on the current stream without waiting (one DMA each, no per-block round trip), then
        the stream is synchronized once: the bytes are in place when this returns."""
        pending = False
        for dst, src in zip(dsts, srcs):
            if dst.is_cuda != src.is_cuda and (dst.is_pinned() or src.is_pinned()):
                dst.copy_(src, non_blocking=True)
                pending = True
            else:
                copy_block(dst, src)
        if pending:
            torch.cuda.current_stream().synchronize()

    def _make_room(self, num_needed: int, tenant: bytes) -> None:
        """Evict `num_needed` blocks for new blocks of `tenant`, demoting them first. Raises
        `DiskFullError` before anything here changed: the victims stay."""
        if num_needed <= 0:
            return
        res = self._res
        victims = res.take_victims(num_needed, tenant)
        if self.below is not None:
            if self._checksum:  # a damaged victim is dropped, never copied down
                damaged = [h for h in victims if self._sum(self._index[h]) != self._slot_sums[self._index[h]]]
                if damaged:
                    self.counters.num_corrupt += len(damaged)
                    self._release(damaged)
                    gone = set(damaged)
                    victims = [h for h in victims if h not in gone]
            slots = [self._index[h] for h in victims]
            try:
                self._send_down([self._key_at(s) for s in slots], [self._slab[s] for s in slots])
            except BaseException:
                res.restore(victims)
                raise
        self._release(victims)
        self.counters.num_evictions += len(victims)

    def _release(self, victims: list[BlockHash]) -> None:
        """Free the slots of victims taken from the residency (they left the tier)."""
        gone = [self._vacate(h) for h in victims]
        self._res.commit(victims)
        self._record(ChangeKind.LEFT, gone)

    def _vacate(self, block_hash: BlockHash) -> BlockKey:
        """Free the slot of a held block; the block's key."""
        slot = self._index.pop(block_hash)
        key = self._key_at(slot)
        self._slot_keys[slot] = None
        self._free.append(slot)
        return key

    def spill(self) -> int:
        """Copy every block not yet below down to it, most recently used first; keep them here.

        Returns how many blocks the tier below wrote. Used to persist the tier on shutdown.
        """
        self._check_open()
        below = self.below
        if below is None or not self._index:
            return 0
        order = self._drop_damaged(self._res.order())
        slots = [self._index[h] for h in order]
        keys = [self._key_at(s) for s in slots]
        srcs = [self._slab[s] for s in slots]
        # Most recently used first, in chunks: a lower tier that fills up refuses a chunk whole,
        # so the refused chunk goes block by block and the spill ends at the first refusal.
        written, end = 0, len(keys)
        while end > 0:
            start = max(0, end - _SPILL_CHUNK)
            try:
                written += below.demote(keys[start:end], srcs[start:end])
            except DiskFullError:
                for i in range(end - 1, start - 1, -1):
                    try:
                        written += below.demote([keys[i]], [srcs[i]])
                    except DiskFullError:
                        self.num_spill_refused += i + 1
                        return written
            end = start
        return written

    def _key_at(self, slot: int) -> BlockKey:
        key = self._slot_keys[slot]
        assert key is not None, f"CPU tier: slot {slot} holds no block (a bug)"
        return key

    def _sum(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self._slab[slot].view(torch.uint8).numpy().data)

    def _drop_damaged(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """With checksums on, drop the given blocks whose slots fail theirs; return the rest."""
        if not self._checksum:
            return block_hashes
        good = []
        for h in block_hashes:
            slot = self._index[h]
            if self._sum(slot) == self._slot_sums[slot]:
                good.append(h)
            elif not self._res.is_pinned(h):  # a pinned block is left to its holder
                self.counters.num_corrupt += 1
                self._drop(h)
        return good

    # -- bookkeeping -----------------------------------------------------------------------
    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        self._res.touch(block_hashes)

    def deprioritize(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        return self._res.deprioritize(block_hashes)

    def pin(self, block_hashes: Sequence[BlockHash]) -> int:
        """Protect the leading held blocks from eviction; return how many were pinned."""
        self._check_open()
        n = 0
        while n < len(block_hashes) and self._res.pin(block_hashes[n]):
            n += 1
        return n

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Undo `pin` (eviction order). A pinned block deleted meanwhile (it failed validation)
        is skipped; a held block that is not pinned raises `RuntimeError` (a bug)."""
        for h in block_hashes:
            self._res.unpin(h)

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        n = 0
        for h in block_hashes:
            if h in self._index and not self._res.is_pinned(h):
                self._drop(h)
                n += 1
        return n

    def _drop(self, block_hash: BlockHash) -> None:
        key = self._vacate(block_hash)
        self._res.discard(block_hash)
        self._record(ChangeKind.LEFT, [key])

    def clear(self, *, all_namespaces: bool = False) -> None:
        self._check_open()
        gone = [self._vacate(h) for h in list(self._index)]
        self._res.clear()
        self._record(ChangeKind.LEFT, gone)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._index.clear()
            self._res.clear()
            self._slab = torch.empty(0)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("CPU tier is closed")

    def check_integrity(self) -> None:
        slots = list(self._index.values())
        if len(set(slots)) != len(slots):
            raise RuntimeError("CPU tier: two blocks share a slot (a bug)")
        if set(slots) & set(self._free) or len(slots) + len(self._free) != self._num_slots:
            raise RuntimeError(f"CPU tier: {len(slots)} used + {len(self._free)} free != {self._num_slots} "
                               "slots (a bug)")
        if any((k := self._slot_keys[s]) is None or k.block_hash != h for h, s in self._index.items()):
            raise RuntimeError("CPU tier: a slot keeps another block's key (a bug)")
        if len(self._res) != len(self._index) or any(h not in self._res for h in self._index):
            raise RuntimeError("CPU tier: the residency does not hold exactly the indexed blocks (a bug)")
        self._res.check_integrity()

    def occupancy(self) -> Occupancy:
        n = len(self._index)
        return Occupancy(n, self._num_slots, n * self._block_bytes, self._num_slots * self._block_bytes)
