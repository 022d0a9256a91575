"""Mooncake tier: blocks pooled across hosts in a Mooncake Store, shared by every store with
this namespace.

Keys are `kvstrata:<namespace digest hex>:2.<generation>:<block hash hex>`
(`tiers/mooncake/keys.py`): many models and tenants share one Mooncake cluster, and a clear
changes the namespace's generation, so no reader finds an old block from then on. Values are
the self-checking records of the remote tier (`tiers/shared/record.py`): key, namespace,
layout, codec, token ids and a checksum over header and payload; one that fails a check is a
counted miss and is removed.

Blocks move in batches (`batch_put_from`, `batch_get_into`) through a transfer buffer
registered with the client once (`tiers/mooncake/client.py`): records are encoded straight
into it and read out of it, one region per call in flight. Every call is bounded (a worker
thread and a deadline) and every fault (the master down, a timeout, an error code) is a miss
or a dropped write with a counter and a rate-limited warning, never an exception; a breaker
stops calls of one kind (reads, writes) for `cooldown_s` after repeated faults. A read of a
prefix stops at the first block that is absent or fails.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from tiers.base import Occupancy, SweepResult, Tier, TierCounters, TierTraits, check_start
from tiers.changes import ChangeKind
from tiers.codecs import CodecSpec
from tiers.errors import StoreClosedError
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.mooncake.client import ClientParams, Connection, Fault, Lease
from tiers.mooncake.keys import GENERATION_BYTES, KeyLayout, new_generation, parse_generation
from tiers.shared.ratelimit import RateLimitedWarning
from tiers.shared.record import RecordCodec
from tiers.shared.record_check import ChecksRecords, RecordCheck

logger = logging.getLogger(__name__)

MOONCAKE = TierKind("mooncake")
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
TOO_SMALL = -600  # a record longer than the slot a reader gave it (longer than this layout's)
_GEN_SLOT = 4096  # the generation's part of a region (records start after it)
_HEADER_BYTES = 4096  # a record's header beyond its token ids and extras, at most


class MooncakeTier(ChecksRecords, Tier):
    """Blocks in a Mooncake Store, shared by every store with this namespace.

    Invariant: a value returned is bit-exact with what some store put under its key (the
    record's checksum, key, namespace, layout and token ids are checked) since the last clear
    of its namespace (the generation); anything else is removed and reported as absent. A
    call moving n bytes must end within `timeout_s + n / min_rate_bps`, else it is a fault.
    """

    kind = MOONCAKE
    traits = TierTraits(persistent=True, shared=True)

    def __init__(self, params: ClientParams, block_shape: tuple[int, ...], dtype: torch.dtype, *,
                 namespace: bytes, verify_tokens: bool = True, timeout_s: float = 1.0, min_rate_bps: float = 64 << 20,
                 cooldown_s: float = 5.0, setup_timeout_s: float = 10.0, buffer_bytes: int = 256 << 20,
                 codec: CodecSpec | None = None) -> None:
        self.codec = RecordCodec(block_shape, dtype, verify_tokens=verify_tokens, namespace=namespace, codec=codec)
        self._conn = Connection(params, timeout_s=timeout_s, min_rate_bps=min_rate_bps, cooldown_s=cooldown_s,
                                setup_timeout_s=setup_timeout_s, region_bytes=buffer_bytes // 2)
        self.reads, self.writes = self._conn.reads, self._conn.writes
        self._master = params.master
        self._keys = KeyLayout(namespace)
        self._generation = new_generation()  # the server's, as last read (a fresh value until then)
        self.counters = TierCounters()
        self.num_write_drops = self.num_clears_incomplete = 0
        self._warn_drop, self._warn_data, self._warn_clear = (RateLimitedWarning(logger) for _ in range(3))
        self._checks = RecordCheck(self.codec, self.counters, self._warn_data,
                                   where=f"mooncake tier (master {self._master})")
        self._closed = False
        self._conn.connect(self.writes)  # a master that is down: a counted fault, set up again later

    # -- what it is ----------------------------------------------------------------------------
    @property
    def num_errors(self) -> int:
        """Faults of reads and writes together (`reads.num_errors`, `writes.num_errors`)."""
        return self.reads.num_errors + self.writes.num_errors

    @property
    def identity(self) -> str:
        """The Mooncake master: instances with equal identities share blocks."""
        return f"mooncake://{self._master}"

    @property
    def key_prefix(self) -> str:
        """What every key of this namespace starts with."""
        return self._keys.prefix

    def server_key(self, block_hash: BlockHash) -> str:
        """The key `block_hash` is stored under in the generation last read; changes nothing."""
        return self._keys.key(self._generation, block_hash)

    @property
    def capacity_blocks(self) -> int:
        return 1 << 40  # the cluster's segments decide

    def __len__(self) -> int:
        return 0  # Mooncake lists no keys: blocks are not counted

    def occupancy(self) -> Occupancy:
        return Occupancy(0, self.capacity_blocks, 0, 0)

    def _slot(self, key: BlockKey) -> int:
        """The bytes a reader gives `key`'s record first: the longest record of this layout
        with `key`'s token ids and extras (a longer one is read again alone, see `_read`)."""
        described = len(key.tokens) + len(key.extras or b"") + len(key.parent or b"")
        return self.codec.block_bytes + _HEADER_BYTES + described

    # -- the generation --------------------------------------------------------------------------
    def _server_generation(self, client: Any, lease: Lease) -> str:
        """The namespace's generation on the server, created (never replaced: `put` keeps an
        existing object) where it has none. Runs on a worker; raises `Fault`."""
        key = self._keys.generation_key
        for attempt in range(2):
            code = client.batch_get_into([key], [lease.address], [_GEN_SLOT])[0]
            if code == NOT_FOUND and attempt == 0:
                client.put(key, new_generation().encode())
                continue
            value = parse_generation(lease.view[: max(code, 0)]) if code == GENERATION_BYTES else None
            if value is None:
                raise Fault(f"the generation key holds no generation (code {code})")
            self._generation = value
            return value
        raise Fault("the generation key could not be created")

    # -- reads -----------------------------------------------------------------------------------
    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        check_start(start)
        todo = list(block_hashes[start:])
        lease = self._conn.lease(self.reads, "lookup") if todo else None
        if lease is None:
            return 0
        try:
            def native(client: Any) -> list[int]:
                gen = self._server_generation(client, lease)
                return list(client.batch_is_exist([self._keys.key(gen, h) for h in todo]))

            codes = self._conn.run(self.reads, "lookup", 64 * len(todo), native, lease) or []
        finally:
            lease.drop()
        n = 0
        while n < len(codes) and codes[n] == 1:
            n += 1
        if n < len(codes) and codes[n] not in (0, 1):
            self._conn.fault(self.reads, "lookup", Fault(f"error code {codes[n]}"))
        return n

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        n = 0
        while n < len(keys):
            got, ended = self._read(keys[n:], dsts[n:])
            n += got
            if ended:
                break
        return n

    def _read(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> tuple[int, bool]:
        """Read as many of `keys` as fit one region in one batch, validate each and copy it into
        its `dsts`; stop at the first that is absent or fails. Returns how many were copied
        and whether the read ended (False: the region was full, read on)."""
        lease = self._conn.lease(self.reads, "read")
        if lease is None:
            return 0, True
        try:
            room = len(lease.view) - _GEN_SLOT  # the most one record can take of the region
            offsets: list[int] = []
            sizes: list[int] = []
            end = _GEN_SLOT
            for k in keys:
                size = self._slot(k) if offsets else min(self._slot(k), room)
                if end + size > len(lease.view):
                    break
                offsets.append(end)
                sizes.append(size)
                end += size
            if not offsets:
                self._checks.damaged("a block larger than the transfer buffer's region (buffer_bytes too small)")
                return 0, True
            batch = keys[: len(offsets)]

            def native(client: Any) -> list[int]:
                gen = self._server_generation(client, lease)
                codes = list(client.batch_get_into([self._keys.key(gen, k.block_hash) for k in batch],
                                                   [lease.address + o for o in offsets], sizes))
                cut = next((i for i, code in enumerate(codes) if code < 0), len(codes))
                if cut < len(codes) and codes[cut] == TOO_SMALL and sizes[cut] < room:
                    # longer than its slot (the writer's key carried extras this one lacks, or many):
                    # the batch ends before it, and it is read again alone, with the whole region
                    codes = codes[:cut] if cut else list(client.batch_get_into(
                        [self._keys.key(gen, batch[0].block_hash)], [lease.address + _GEN_SLOT], [room]))
                if self._server_generation(client, lease) != gen:  # a clear ran meanwhile: serve none of it
                    return [NOT_FOUND] * len(codes)
                return codes

            codes = self._conn.run(self.reads, "read", end, native, lease)
            if codes is None:
                return 0, True
            batch = batch[: len(codes)]
            n, damaged = 0, list[BlockHash]()
            for key, dst, off, code in zip(batch, dsts, offsets, codes):
                if code == TOO_SMALL:
                    self._checks.damaged("a value longer than the transfer buffer's region: "
                                         "not a record of this layout",
                                         partial(damaged.append, key.block_hash))
                if code < 0:
                    if code not in (NOT_FOUND, TOO_SMALL):
                        self._conn.fault(self.reads, "read", Fault(f"error code {code}"))
                    break
                if not self._checks.take(lease.view[off : off + code], key, dst,
                                         partial(damaged.append, key.block_hash)):
                    break
                n += 1
        finally:
            lease.drop()
        if damaged:
            self.discard(damaged)
        return n, n < len(batch) or len(batch) == len(keys)

    # -- writes ----------------------------------------------------------------------------------
    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        """Write the records, parents first (the reverse of the eviction order given), in
        batches of one region each; a batch that fails drops it and every later one (children
        of what failed), counted."""
        order = list(range(len(keys) - 1, -1, -1))
        written = 0
        while order:
            done, sent = self._write(keys, srcs, order)
            written += done
            if done < sent or sent == 0:
                self._dropped(len(order) - done, "the write failed")
                break
            order = order[sent:]
        return written

    def _write(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor], order: list[int]) -> tuple[int, int]:
        """Encode as many blocks of `order` as fit one region into it and put them in one batch;
        how many were stored and how many were sent."""
        lease = self._conn.lease(self.writes, "write")
        if lease is None:
            return 0, 0
        try:
            offsets, sizes, end = [], [], _GEN_SLOT
            for i in order:
                size = self.codec.encode_into(keys[i], srcs[i], lease.view[end:])
                if size is None:
                    break
                offsets.append(end)
                sizes.append(size)
                end += size
            batch = [keys[i] for i in order[: len(offsets)]]

            def native(client: Any) -> list[int]:
                gen = self._server_generation(client, lease)
                return list(client.batch_put_from([self._keys.key(gen, k.block_hash) for k in batch],
                                                  [lease.address + o for o in offsets], sizes))

            codes = self._conn.run(self.writes, "write", end, native, lease) if batch else None
        finally:
            lease.drop()
        if codes is None:
            return 0, len(batch)
        stored = 0
        while stored < len(codes) and codes[stored] == 0:
            stored += 1
        if stored < len(codes):
            self._conn.fault(self.writes, "write", Fault(f"error code {codes[stored]}"))
        self._record(ChangeKind.ENTERED, batch[:stored])
        return stored, len(batch)

    def _dropped(self, num: int, why: str) -> None:
        self.num_write_drops += num
        if num:
            self._warn_drop(f"mooncake tier (master {self._master}): {num} block writes dropped ({why})")

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Nothing: Mooncake's eviction sees every read."""

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        self._check_open()
        lease = self._conn.lease(self.writes, "remove") if block_hashes else None
        if lease is None:
            return 0
        try:
            keys = [self.server_key(h) for h in block_hashes]
            codes = self._conn.run(self.writes, "remove", 64 * len(keys),
                                   lambda client: list(client.batch_remove(keys, True)), lease) or []
        finally:
            lease.drop()
        gone = [h for h, code in zip(block_hashes, codes) if code == 0]
        self._record(ChangeKind.LEFT, gone)
        return len(gone)

    def clear(self, *, all_namespaces: bool = False) -> None:
        """`sweep` (whose result says whether it finished)."""
        self.sweep(all_namespaces=all_namespaces)

    def sweep(self, *, all_namespaces: bool = False) -> SweepResult:
        """Clear this namespace: a fresh generation first (from then on no reader finds its
        old blocks), then remove the old blocks (with `all_namespaces`, every kvstrata key in
        the store but this namespace's new generation) by a regular expression. An incomplete
        clear (a fault) is counted in `num_clears_incomplete`, with a rate-limited warning."""
        self._check_open()
        generation = new_generation()
        pattern = (self._keys.swept_pattern if all_namespaces else self._keys.stale_pattern)(generation)
        lease = self._conn.lease(self.writes, "clear")
        result: tuple[int, int] | None = None
        if lease is not None:
            try:
                result = self._conn.run(self.writes, "clear", 1 << 20, lambda client: (
                    client.upsert(self._keys.generation_key, generation.encode()),
                    client.remove_by_regex(pattern, True)), lease)
            finally:
                lease.drop()
        renewed = result is not None and result[0] == 0
        if renewed:
            self._generation = generation
        removed = result[1] if result is not None else -1
        done = SweepResult(max(removed, 0), renewed and removed >= 0)
        if not done.complete:
            self.num_clears_incomplete += 1
            self._warn_clear(f"mooncake tier (master {self._master}): a clear did not finish (codes {result}); "
                             + ("its old blocks are unreachable" if renewed else "its blocks may still be read"))
        return done

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._conn.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"mooncake tier (master {self._master}) is closed")

    def check_integrity(self) -> None:
        self._conn.regions.check()
