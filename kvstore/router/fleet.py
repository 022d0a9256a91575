"""The router's view of a fleet: instances, their event streams, and the block index they feed.

Pure state, no I/O: the service hands it decoded messages and asks it what to request.
Per instance it tracks the publisher epoch and the last batch sequence applied. A batch from
an unknown instance, a new epoch (the instance restarted) or a gap in the sequence puts the
instance into resync: its live batches are buffered, the service fetches a snapshot, and
`apply_snapshot` replaces the instance's blocks with it and replays the buffered batches
newer than the snapshot. A remote tier shared by several instances is a slot of its own:
every instance naming it can serve its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.config import HashAlgo
from kvstore.events import CLEARED, REMOVED, STORED, EventSource, split_hashes
from kvstore.hashing import BlockHash, ExtraKeys, chain_hashes
from kvstore.router.index import REMOTE, TIER_BIT, KVIndex, block_key

logger = logging.getLogger(__name__)
_MAX_BUFFERED = 10_000  # batches held while a snapshot is on its way


@dataclass
class Instance:
    """One engine instance as the router knows it."""

    source: EventSource
    slot: int
    endpoint: str | None = None  # the events endpoint it was heard on
    seq: int = 0  # last batch applied
    synced: bool = False
    last_seen: float = 0.0
    snapshot_asked: float | None = None
    buffered: list[tuple[int, list[Any]]] = field(default_factory=list)
    # vLLM's own GPU events: vLLM block hash -> (kvstrata digest, block index in its sequence)
    vllm_blocks: dict[object, tuple[bytes, int]] = field(default_factory=dict)

    @property
    def digest_bytes(self) -> int:
        return HashAlgo(self.source.algo).digest_bytes


class FleetView:
    """Instances, remote-tier slots and the block index; see the module docstring."""

    def __init__(self, *, stale_after_s: float = 5.0) -> None:
        self.index = KVIndex()
        self.instances: dict[str, Instance] = {}
        self._slots: dict[str, int] = {}  # instance id or "remote:<url>" -> slot
        self.stale_after_s = stale_after_s
        self.num_batches = self.num_resyncs = self.num_snapshots = self.num_bad_messages = 0
        self.num_vllm_blocks = self.num_vllm_unmapped = 0

    # -- slots ------------------------------------------------------------------------------
    def _slot(self, name: str) -> int:
        if name not in self._slots:
            self._slots[name] = len(self._slots)
        return self._slots[name]

    def remote_slot(self, inst: Instance) -> int | None:
        return self._slot("remote:" + inst.source.remote) if inst.source.remote else None

    def alive(self, inst: Instance, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) - inst.last_seen <= self.stale_after_s

    # -- kvstrata events ------------------------------------------------------------------
    def on_batch(self, seq: int, payload: dict[str, Any], endpoint: str | None = None,
                 now: float | None = None) -> Instance | None:
        """Apply one live batch. Returns the instance if it needs a snapshot now (the caller
        fetches it and calls `apply_snapshot`), else None. Malformed payloads are counted
        and ignored."""
        now = time.monotonic() if now is None else now
        try:
            source = EventSource.from_wire(payload.get("src"))
            events = payload.get("ev")
            if not isinstance(events, list):
                raise ValueError("ev is not a list")
        except (ValueError, AttributeError) as exc:
            self.num_bad_messages += 1
            logger.debug("kvstrata router: bad batch: %s", exc)
            return None
        self.num_batches += 1
        inst = self.instances.get(source.instance_id)
        if inst is None or inst.source.epoch != source.epoch:
            if inst is not None:
                logger.info("kvstrata router: %s restarted (new epoch); resynchronising", source.instance_id)
                self._forget(inst)
            inst = Instance(source, self._slot(source.instance_id))
            self.instances[source.instance_id] = inst
        inst.source, inst.last_seen = source, now
        if endpoint is not None:
            inst.endpoint = endpoint
        if inst.synced and seq == inst.seq + 1:
            self._apply(inst, events)
            inst.seq = seq
            return None
        if inst.synced and seq <= inst.seq:
            return None  # already applied (a duplicate)
        if inst.synced:
            logger.info("kvstrata router: %s skipped from batch %d to %d; resynchronising",
                        source.instance_id, inst.seq, seq)
            inst.synced = False
        if len(inst.buffered) < _MAX_BUFFERED:
            inst.buffered.append((seq, events))
        if inst.snapshot_asked is None or now - inst.snapshot_asked > 5.0:
            inst.snapshot_asked = now
            self.num_resyncs += 1
            return inst
        return None

    def apply_snapshot(self, seq: int, payload: dict[str, Any]) -> bool:
        """Replace an instance's blocks with a snapshot taken at batch `seq`, then replay the
        buffered batches after it. False if the snapshot is malformed or stale (another
        epoch)."""
        try:
            source = EventSource.from_wire(payload.get("src"))
            tiers = payload.get("tiers")
            if not isinstance(tiers, dict):
                raise ValueError("tiers is not a map")
        except (ValueError, AttributeError):
            self.num_bad_messages += 1
            return False
        inst = self.instances.get(source.instance_id)
        if inst is None or inst.source.epoch != source.epoch:
            return False
        self.index.clear(inst.slot)
        inst.vllm_blocks.clear()
        for tier, blob in tiers.items():
            self._tier_event(inst, STORED, tier, blob)
        inst.seq, inst.synced, inst.snapshot_asked = seq, True, None
        for batch_seq, events in sorted(inst.buffered, key=lambda b: b[0]):
            if batch_seq > inst.seq:
                if batch_seq != inst.seq + 1:  # a gap inside the buffer: ask again
                    inst.synced = False
                    break
                self._apply(inst, events)
                inst.seq = batch_seq
        inst.buffered = [] if inst.synced else inst.buffered
        self.num_snapshots += 1
        return inst.synced

    def _apply(self, inst: Instance, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, list) and len(event) == 3:
                self._tier_event(inst, *event)
            else:
                self.num_bad_messages += 1

    def _tier_event(self, inst: Instance, op: object, tier: object, blob: object) -> None:
        bit = TIER_BIT.get(tier) if isinstance(tier, str) else None
        if bit is None or not isinstance(blob, bytes):
            self.num_bad_messages += 1
            return
        slot = self.remote_slot(inst) if bit == REMOTE else inst.slot
        if slot is None:
            return
        if op == CLEARED:
            self.index.clear(slot, bit)
            return
        try:
            keys = [block_key(h) for h in split_hashes(blob, inst.digest_bytes)]
        except ValueError:
            self.num_bad_messages += 1
            return
        if op == STORED:
            self.index.add(slot, bit, keys)
        elif op == REMOVED:
            self.index.remove(slot, bit, keys)
        else:
            self.num_bad_messages += 1

    def _forget(self, inst: Instance) -> None:
        self.index.clear(inst.slot)
        inst.vllm_blocks.clear()

    # -- vLLM's own KV events (its GPU blocks) ------------------------------------------------
    def on_vllm_batch(self, instance_id: str, payload: object) -> None:
        """Apply a vLLM `KVEventBatch` (msgpack-decoded) from `instance_id`'s engine: its GPU
        blocks enter the index as that instance's "pool" tier, keyed by kvstrata's chain
        (recomputed from the token ids the events carry). Blocks whose keys depend on what
        the events do not carry exactly (LoRA adapters: their path and id; multimodal
        inputs; prompt embeddings) are left out and counted; so are blocks whose parent the
        router never saw, and all of them until the instance's kvstrata events arrive."""
        inst = self.instances.get(instance_id)
        if not isinstance(payload, list) or len(payload) < 2 or not isinstance(payload[1], list):
            self.num_bad_messages += 1
            return
        for event in payload[1]:
            if not isinstance(event, dict):
                self.num_bad_messages += 1
                continue
            kind = event.get("type")
            if inst is None:
                self.num_vllm_unmapped += len(event.get("block_hashes") or ())
                continue
            if kind == "BlockStored":
                self._vllm_stored(inst, event)
            elif kind == "BlockRemoved":
                if event.get("medium") not in (None, "GPU"):
                    continue
                gone = [inst.vllm_blocks.pop(h, None) for h in event.get("block_hashes") or ()]
                self.index.remove(inst.slot, TIER_BIT["pool"], [block_key(g[0]) for g in gone if g is not None])
            elif kind == "AllBlocksCleared":
                self.index.remove(inst.slot, TIER_BIT["pool"], [block_key(d) for d, _ in inst.vllm_blocks.values()])
                inst.vllm_blocks.clear()

    def _vllm_stored(self, inst: Instance, event: dict[str, Any]) -> None:
        hashes, tokens = event.get("block_hashes") or [], event.get("token_ids") or []
        if event.get("medium") not in (None, "GPU"):
            return
        block_size = event.get("block_size")
        extras = event.get("extra_keys") or [None] * len(hashes)
        if (block_size != inst.source.block_size or len(tokens) != len(hashes) * block_size
                or len(extras) != len(hashes) or event.get("lora_name") or event.get("lora_id")):
            self.num_vllm_unmapped += len(hashes)
            return
        parent = event.get("parent_block_hash")
        if parent is None:
            prev, depth = bytes(inst.source.seed), 0
        elif parent in inst.vllm_blocks:
            prev, depth = inst.vllm_blocks[parent]
            depth += 1
        else:
            self.num_vllm_unmapped += len(hashes)
            return
        algo = HashAlgo(inst.source.algo)
        added: list[int] = []
        for i, vllm_hash in enumerate(hashes):
            extra = extras[i]
            keys: ExtraKeys | None = None
            if extra:  # only a cache salt on a sequence's first block maps exactly
                if depth != 0 or len(extra) != 1 or not isinstance(extra[0], str):
                    self.num_vllm_unmapped += len(hashes) - i
                    break
                keys = ExtraKeys(cache_salt=extra[0])
            try:
                arr = np.asarray(tokens[i * block_size : (i + 1) * block_size], dtype="<u4")
            except (OverflowError, ValueError, TypeError):
                self.num_vllm_unmapped += len(hashes) - i
                break
            digest = chain_hashes(arr, block_size, BlockHash(prev), keys, algo, first_block=depth)[0]
            inst.vllm_blocks[vllm_hash] = (digest, depth)
            added.append(block_key(digest))
            prev, depth = digest, depth + 1
        self.index.add(inst.slot, TIER_BIT["pool"], added)
        self.num_vllm_blocks += len(added)

    # -- queries ----------------------------------------------------------------------------
    def candidates(self, model: str | None, now: float | None = None) -> list[Instance]:
        """Live instances (heard from within `stale_after_s`), of `model` when given."""
        now = time.monotonic() if now is None else now
        return [i for i in self.instances.values()
                if self.alive(i, now) and (model is None or i.source.model == model)]

    def match(self, tokens: Any, extra_keys: ExtraKeys | None,
              instances: Iterable[Instance]) -> dict[str, list[int]]:
        """Per instance, blocks of the longest cached prefix of `tokens` (a validated uint32
        array) by tier, `[pool, cpu, disk, remote]`. Hashes once per distinct namespace."""
        groups: dict[tuple[bytes, str, int], list[Instance]] = {}
        for inst in instances:
            groups.setdefault((inst.source.seed, inst.source.algo, inst.source.block_size), []).append(inst)
        out: dict[str, list[int]] = {}
        for (seed, algo, block_size), members in groups.items():
            digests = chain_hashes(tokens, block_size, BlockHash(seed), extra_keys, HashAlgo(algo))
            keys = [block_key(d) for d in digests]
            counts = self.index.match(keys, [(m.slot, self.remote_slot(m)) for m in members])
            for member, count in zip(members, counts):
                out[member.source.instance_id] = count
        return out
