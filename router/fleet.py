"""The router's view of a fleet: event sources, the instances they make up, and the block
index they feed. Pure state, no I/O: the subscriber hands it decoded batches and asks it
what to request.

Per source, batches apply in sequence. A batch numbered at or below the last one applied
means the publisher restarted (vLLM counts from 0 per lifetime), as does a new kvstrata
epoch (kvstrata's numbers continue above its last lifetime's): the source's own blocks are
forgotten, and the new lifetime's numbers are no gap. A skipped number is a gap: with a replay
endpoint the source replays from the first batch missed (live batches are buffered
meanwhile); without one, it carries on. Blocks are indexed by the router's own key chain
(`router/blocks.py`); a block whose parent the source never announced, or whose extra keys a
`/lookup` cannot express, is left out and counted.

A source may change only what it announced itself. Every block a source announces, in any
tier, is in its own slot. A shared remote tier is a group of sources, keyed by the remote
tier's identity and the namespace fingerprint they give: an instance reading it counts the
remote blocks any member announced, so a block leaves the shared view only once no member
holds it, and one member's removal or clear (or one claiming the group to send them) takes
only its own. Everything is bounded: sources, blocks per slot, distinct block sizes, remote
groups, buffered batches; sources silent for `forget_after_s` are forgotten.

Work is bounded per source: forgetting a slot's blocks walks that slot's chain map (what it
holds), never the index; each source has a budget of message bytes a second (decoding and
applying cost about what the bytes hold) and of live batches claiming a restart or a clear
a second. A message over a budget is dropped and counted, the sequence not advanced: the
next batch taken shows the gap and is resynced as any other gap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router import blocks
from router.decode import Cleared, Event, Meta, Removed, Stored
from router.index import KVIndex, tier_masks
from router.keys import ROOT, chain
from router.source import REMOTE_TIER, TIER_OF_MEDIUM, Bucket, Slot, Source

logger = logging.getLogger(__name__)


class FleetFull(Exception):
    """No room for another source (`Limits.max_sources`)."""


@dataclass(frozen=True)
class Limits:
    """Bounds on everything the router keeps per peer."""

    max_sources: int = 256
    max_blocks_per_slot: int = 1 << 21
    max_block_sizes: int = 4
    max_remote_slots: int = 64  # shared remote tiers (identity, namespace) known at once
    max_buffered: int = 1024
    stale_after_s: float = 5.0
    forget_after_s: float = 600.0
    replay_interval_s: float = 2.0
    bytes_per_s: float = 8 << 20  # message bytes taken from one source a second ...
    burst_bytes: float = 256 << 20  # ... and at once (a whole state of 2^21 blocks fits)
    claims_per_s: float = 2.0  # live batches claiming a restart or a clear, per source a second ...
    burst_claims: float = 10.0  # ... and at once


class FleetView:
    """Sources, slots and the block index; see the module docstring."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.index = KVIndex()
        self.sources: dict[str, Source] = {}
        self.remote_groups: dict[tuple[str, str], set[str]] = {}  # -> endpoints of its members
        self._free: list[int] = []
        self._next = 0
        self._block_sizes: dict[int, set[str]] = {}  # block size -> endpoints using it
        self.num_batches = self.num_bad_messages = self.num_bad_events = self.num_unmapped = 0
        self.num_dropped_blocks = self.num_gaps = self.num_restarts = self.num_replays = self.num_forgotten = 0
        self.num_throttled = 0

    # -- slots and sources ----------------------------------------------------------------
    def _slot(self) -> Slot:
        index = self._free.pop() if self._free else self._next
        self._next = max(self._next, index + 1)
        return Slot(index)

    def _release(self, slot: Slot) -> None:
        blocks.drop(self.index, slot, 0xF)
        self._free.append(slot.index)

    def add(self, endpoint: str, name: str, *, replay: str | None = None, model: str | None = None,
            curve_server_key: bytes | None = None, registered: bool = False) -> Source:
        """A new source (or the one at `endpoint`, renamed). Raises `FleetFull`."""
        src = self.sources.get(endpoint)
        if src is not None:
            src.name, src.replay_endpoint, src.model, src.curve_server_key = name, replay, model, curve_server_key
            return src
        if len(self.sources) >= self.limits.max_sources:
            raise FleetFull(f"the router already follows {len(self.sources)} sources (its limit)")
        src = Source(endpoint, name, self._slot(), replay, model, curve_server_key, registered)
        limits = self.limits
        src.bytes_budget = Bucket(limits.bytes_per_s, limits.burst_bytes)
        src.claims_budget = Bucket(limits.claims_per_s, limits.burst_claims)
        self.sources[endpoint] = src
        return src

    def remove(self, endpoint: str) -> Source | None:
        src = self.sources.pop(endpoint, None)
        if src is not None:
            self._forget(src)
            self._release(src.slot)
        return src

    def _forget(self, src: Source) -> None:
        """Free everything the source holds; it starts over with its next batch."""
        blocks.drop(self.index, src.slot, 0xF)
        self._set_remote(src, None)
        if src.block_size is not None:
            self._block_sizes.get(src.block_size, set()).discard(src.endpoint)
            if not self._block_sizes.get(src.block_size, True):
                del self._block_sizes[src.block_size]
        src.reset()

    def _set_remote(self, src: Source, remote: tuple[str, str] | None) -> None:
        """Make `src` a member of the shared remote tier `remote` (None: of none). The remote
        blocks it announced as a member of another are forgotten: they were not this one's.
        Past `max_remote_slots` groups, its remote blocks count for its own instance only."""
        if remote == src.remote:
            return
        if src.remote is not None:
            blocks.drop(self.index, src.slot, 1 << REMOTE_TIER)
            members = self.remote_groups[src.remote]
            members.discard(src.endpoint)
            if not members:
                del self.remote_groups[src.remote]
        src.remote = None
        if remote is not None and (remote in self.remote_groups
                                   or len(self.remote_groups) < self.limits.max_remote_slots):
            self.remote_groups.setdefault(remote, set()).add(src.endpoint)
            src.remote = remote

    # -- the stream -----------------------------------------------------------------------
    def admit(self, src: Source, nbytes: int, now: float) -> bool:
        """Whether a message of `nbytes` from `src` fits its budget of bytes (spent if so);
        one that does not is counted as throttled and must be dropped undecoded."""
        if src.bytes_budget is None or src.bytes_budget.take(nbytes, now):
            return True
        self._throttled(src, "bytes")
        return False

    def _throttled(self, src: Source, what: str) -> None:
        src.num_throttled += 1
        self.num_throttled += 1
        if src.num_throttled & (src.num_throttled - 1) == 0:  # the 1st, 2nd, 4th, 8th...
            logger.warning("kvstrata router: %s is over its budget of %s a second: %d messages dropped so far",
                           src.endpoint, what, src.num_throttled)

    def _claims(self, src: Source, seq: int, events: list[Event]) -> bool:
        """Whether a batch claims a restart or a clear (what costs the source's whole state)."""
        if src.seq is not None and seq <= src.seq:
            return True
        return _new_epoch(src, events) or any(isinstance(e, Cleared) for e in events)

    def on_live(self, src: Source, seq: int, events: list[Event], now: float) -> int | None:
        """Take one live batch; returns the batch number to replay from when a replay should
        be requested now (the caller requests it and then calls `on_replay`), else None. A
        batch claiming a restart or a clear over the source's budget is dropped (counted)."""
        src.last_seen = now
        src.num_batches += 1
        self.num_batches += 1
        if (not src.replaying and src.claims_budget is not None and self._claims(src, seq, events)
                and not src.claims_budget.take(1.0, now)):
            self._throttled(src, "restarts and clears")
            return None
        if src.replaying:
            if len(src.buffered) < self.limits.max_buffered:
                src.buffered.append((seq, events))
            else:
                src.num_dropped += 1  # the replay's answer no longer joins the live stream
            return None
        if (src.seq is not None and seq <= src.seq) or _new_epoch(src, events):
            self.num_restarts += 1
            logger.info("kvstrata router: %s restarted (batch %d after %s)", src.endpoint, seq, src.seq)
            self._forget(src)  # a new lifetime: its numbers are no gap
        if src.seq is not None and seq > src.seq + 1:
            self.num_gaps += 1
            if self.start_replay(src, now):
                src.buffered.append((seq, events))
                return src.seq + 1
        self.apply(src, events)
        src.seq = seq
        return None

    def start_replay(self, src: Source, now: float) -> bool:
        """Whether a replay may be requested now (one at a time, at most one per
        `replay_interval_s`); if so, the source buffers live batches until `on_replay`."""
        if src.replay_endpoint is None or src.replaying or now - src.last_replay < self.limits.replay_interval_s:
            return False
        src.replaying, src.last_replay = True, now
        self.num_replays += 1
        return True

    def on_replay(self, src: Source, start: int, batches: Sequence[tuple[int, list[Event]]]) -> None:
        """Apply a replay's answer (batches numbered from `start` on; a publisher answering
        from its whole state tags every batch with its latest number), then the live batches
        buffered meanwhile that are newer. An empty answer leaves the live stream as it was."""
        src.replaying = False
        for seq, events in batches:
            if seq >= start:
                self.apply(src, events)
                src.seq = seq if src.seq is None else max(src.seq, seq)
        buffered, src.buffered = src.buffered, []
        for seq, events in sorted(buffered, key=lambda b: b[0]):
            if src.seq is None or seq > src.seq:
                self.apply(src, events)
                src.seq = seq

    def apply(self, src: Source, events: list[Event]) -> None:
        for event in events:
            if event.meta is not None:
                self._meta(src, event.meta)
            if isinstance(event, Stored):
                self._stored(src, event)
            elif isinstance(event, Removed):
                tier = TIER_OF_MEDIUM.get(event.medium, -1)
                if tier < 0:
                    self.num_bad_events += 1
                    continue
                blocks.remove(self.index, src.slot, tier, event.hashes)
            elif isinstance(event, Cleared):
                self._cleared(src, event)

    def _meta(self, src: Source, meta: Meta) -> None:
        if meta.epoch is not None:
            if src.epoch is not None and meta.epoch != src.epoch:
                self.num_restarts += 1
                blocks.drop(self.index, src.slot, 0xF)
            src.epoch = meta.epoch
        src.announced_model = meta.model or src.announced_model
        if meta.block_size is not None and src.block_size is None:
            self._block_size_ok(src, meta.block_size)
        self._set_remote(src, (meta.remote, meta.namespace) if meta.remote and meta.namespace else None)

    def _block_size_ok(self, src: Source, size: int) -> bool:
        if src.block_size is not None:
            return size == src.block_size
        if size not in self._block_sizes and len(self._block_sizes) >= self.limits.max_block_sizes:
            return False
        self._block_sizes.setdefault(size, set()).add(src.endpoint)
        src.block_size = size
        return True

    def _stored(self, src: Source, event: Stored) -> None:
        tier = TIER_OF_MEDIUM.get(event.medium, -1)
        n = len(event.hashes)
        parent = ROOT if event.parent is None else self._parent(src, tier, event.parent)
        if tier < 0 or not self._block_size_ok(src, event.block_size):
            self.num_bad_events += 1
            parent = None
        written = blocks.Written(0, 0)
        if parent is not None:
            written = blocks.store(self.index, src.slot, tier, event, parent, self.limits.max_blocks_per_slot)
        src.num_dropped += written.dropped
        self.num_dropped_blocks += written.dropped
        src.num_unmapped += n - written.done - written.dropped
        self.num_unmapped += n - written.done - written.dropped

    def _parent(self, src: Source, tier: int, parent: int) -> int | None:
        """The router key of a block's parent: in the source's own chain map or, for a block
        of a shared remote tier, in another member's (it may have written the prefix)."""
        found = src.slot.chain.get(parent)
        if found is None and tier == REMOTE_TIER and src.remote is not None:
            for endpoint in self.remote_groups.get(src.remote, ()):
                found = self.sources[endpoint].slot.chain.get(parent)
                if found is not None and found[1] & 1 << REMOTE_TIER:
                    break
                found = None
        return found[0] if found is not None else None

    def _cleared(self, src: Source, event: Cleared) -> None:
        """Forget the source's own blocks in the media the clear names (all, naming none)."""
        media = event.meta.media if event.meta is not None else None
        tiers = 0xF if media is None else sum({1 << TIER_OF_MEDIUM[m] for m in media if m in TIER_OF_MEDIUM})
        blocks.drop(self.index, src.slot, tiers)

    # -- queries ----------------------------------------------------------------------------
    def alive(self, src: Source, now: float) -> bool:
        return now - src.last_seen <= self.limits.stale_after_s

    def instances(self) -> dict[str, list[Source]]:
        out: dict[str, list[Source]] = {}
        for src in self.sources.values():
            out.setdefault(src.name, []).append(src)
        return out

    def candidates(self, model: str | None, now: float) -> dict[str, list[Source]]:
        """Instances with a live source, of `model` when given."""
        return {name: srcs for name, srcs in self.instances().items()
                if any(self.alive(s, now) for s in srcs)
                and (model is None or any(s.label == model for s in srcs))}

    def match(self, tokens: np.ndarray, salt: str | None, lora: str | None,
              instances: dict[str, list[Source]]) -> dict[str, tuple[list[int], int]]:
        """Per instance: blocks of the longest cached prefix of `tokens` by tier, `[pool, cpu,
        disk, remote]`, and their block size: an instance counts its own sources' blocks in
        every tier, and the remote blocks of every member of the shared remote tiers its
        sources read. Hashes once per distinct block size."""
        shared: dict[tuple[tuple[str, str], int | None], int] = {}  # (group, block size) -> members' remote bits
        for group, members in self.remote_groups.items():
            for member in (self.sources[e] for e in members):
                key = (group, member.block_size)
                shared[key] = shared.get(key, 0) | 1 << (4 * member.slot.index + REMOTE_TIER)
        by_size: dict[int, list[tuple[str, tuple[int, int, int, int]]]] = {}
        for name, srcs in instances.items():
            for size in {s.block_size for s in srcs if s.block_size is not None}:
                m0, m1, m2, m3 = tier_masks([(s.slot.index, 0xF) for s in srcs if s.block_size == size])
                for group in {s.remote for s in srcs if s.remote is not None}:
                    m3 |= shared.get((group, size), 0)
                by_size.setdefault(size, []).append((name, (m0, m1, m2, m3)))
        out: dict[str, tuple[list[int], int]] = {name: ([0, 0, 0, 0], 0) for name in instances}
        for size, entries in by_size.items():
            keys = chain(tokens, size, salt, lora)
            for (name, _), counts in zip(entries, self.index.match(keys, [g for _, g in entries])):
                if sum(counts) * size > sum(out[name][0]) * out[name][1]:
                    out[name] = (counts, size)
        return out

    def sweep(self, now: float) -> list[Source]:
        """Forget the state of sources silent for `forget_after_s`; registered ones are
        removed entirely (they register again). Returns the removed sources."""
        removed = []
        for src in list(self.sources.values()):
            if now - src.last_seen > self.limits.forget_after_s and (src.slot.chain or src.seq is not None
                                                                      or src.registered):
                self.num_forgotten += 1
                if src.registered:
                    self.remove(src.endpoint)
                    removed.append(src)
                else:
                    self._forget(src)
        return removed


def _new_epoch(src: Source, events: list[Event]) -> bool:
    """Whether a batch names a kvstrata epoch other than the source's: a new lifetime."""
    return src.epoch is not None and any(e.meta is not None and e.meta.epoch is not None and e.meta.epoch != src.epoch
                                         for e in events)
