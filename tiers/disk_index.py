"""The disk tier's index: a small LMDB environment beside the data files.

Sub-databases (format 2):
- `index`: namespace tag (8 bytes) + block hash -> `Entry` (slot, payload length, xxh3-64,
  write generation, LRU tick, codec id, layout tag, parent hash, extras, token ids);
- `order`: big-endian LRU tick -> index key (the eviction order: lowest tick first);
- `free`: `u`/`p` + big-endian slot size + slot -> b"" (free slots; `p`: its space was
  given back to the file system);
- `log`: big-endian sequence number -> the index keys one write transaction removed and
  added (the last `LOG_KEEP` transactions), from which other processes follow the index;
- `meta`: `format`, `tick`, `used` (accounted bytes), `seq`, `hwm`+slot size (slots ever
  handed out of that file), `ns:`+namespace (who registered it, for `kvstrata inspect`).

`WriteBatch` is the work of one write transaction. Slots it frees enter `free` only when it
ends, so a transaction never overwrites a slot that an entry it may yet roll back (a killed
process, a full disk) still names.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import lmdb
import msgpack
import xxhash

from tiers.errors import CorruptRecordError

FORMAT = b"2"
DB_NAMES = (b"index", b"order", b"free", b"log", b"meta")
OLD_DB_NAMES = (b"blocks", b"atime")  # format 1: records inside LMDB
LOG_KEEP = 1024  # write transactions a process may fall behind before it rebuilds its copy
INDEX_BYTES_PER_BLOCK = 256  # accounted per block beside its slot: entry, order, log
TAG_BYTES = 8
CODEC_RAW = 0

_U64 = struct.Struct("<Q")
_BE = struct.Struct(">Q")
_SLOT = struct.Struct(">QQ")
# format, codec, parent length, layout, slot bytes, slot, length, xxh, gen, extras length, tick
_ENTRY = struct.Struct("<BBHIQQQQQIQ")
_ENTRY_FORMAT = 2
_TICK_AT = _ENTRY.size - 8  # the LRU tick is the header's last field
_NO_EXTRAS = 0xFFFFFFFF  # extras length of an entry whose extras are not known
_BOUND = struct.Struct("<BIQHI")  # what the checksum binds of an entry: codec, layout, length, lengths


class Entry(NamedTuple):
    """One block's index entry. `parent` is b"" and `extras` None where not known (a block
    stored without them); `extras` b"" means the block has none."""

    codec: int
    layout: int
    slot_bytes: int
    slot: int
    length: int
    xxh: int
    gen: int
    tick: int
    parent: bytes
    tokens: bytes
    extras: bytes | None = None


def pack_entry(e: Entry) -> bytes:
    extras = b"" if e.extras is None else e.extras
    return _ENTRY.pack(_ENTRY_FORMAT, e.codec, len(e.parent), e.layout, e.slot_bytes, e.slot, e.length, e.xxh,
                       e.gen, _NO_EXTRAS if e.extras is None else len(extras), e.tick) + e.parent + extras + e.tokens


def unpack_entry(raw: bytes | memoryview) -> Entry:
    """Parse an entry; raise `CorruptRecordError` if it is not one."""
    if len(raw) < _ENTRY.size:
        raise CorruptRecordError("index entry shorter than its header")
    fmt, codec, plen, layout, slot_bytes, slot, length, xxh, gen, xlen, tick = _ENTRY.unpack_from(raw)
    known = xlen != _NO_EXTRAS
    end = plen + (xlen if known else 0)
    if fmt != _ENTRY_FORMAT or _ENTRY.size + end > len(raw) or not 0 < length <= slot_bytes:
        raise CorruptRecordError("malformed index entry")
    rest = bytes(raw[_ENTRY.size :])
    return Entry(codec, layout, slot_bytes, slot, length, xxh, gen, tick, rest[:plen], rest[end:],
                 rest[plen:end] if known else None)


def ns_tag(namespace: bytes) -> bytes:
    """The 8-byte prefix of a namespace's index keys."""
    return xxhash.xxh3_64_digest(b"kvstrata-ns\x00" + namespace)


def block_cost(slot_bytes: int) -> int:
    """Bytes a block is accounted at: its slot plus its share of the index."""
    return slot_bytes + INDEX_BYTES_PER_BLOCK


def checksum(key: bytes, e: Entry) -> Any:
    """An xxh3-64 state over what binds a payload to its entry (key, codec, layout, length,
    parent, extras, token ids); the payload is fed next."""
    extras = b"" if e.extras is None else e.extras
    bound = _BOUND.pack(e.codec, e.layout, e.length, len(e.parent), _NO_EXTRAS if e.extras is None else len(extras))
    return xxhash.xxh3_64(b"".join((key, bound, e.parent, extras, e.tokens)))


class Index:
    """The sub-databases of one environment; every method runs inside the caller's txn."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.index, self.order, self.free, self.log, self.meta = (env.open_db(n) for n in DB_NAMES)

    def get_u64(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self.meta)
        return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0

    def put_u64(self, txn: lmdb.Transaction, name: bytes, value: int) -> None:
        txn.put(name, _U64.pack(value), db=self.meta)

    def keys_of(self, txn: lmdb.Transaction, tag: bytes) -> Iterator[bytes]:
        """Index keys of one namespace (by tag), in key order."""
        cursor = txn.cursor(db=self.index)
        if not cursor.set_range(tag):
            return
        for key in cursor.iternext(values=False):
            key = bytes(key)
            if not key.startswith(tag):
                return
            yield key

    def entries(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, raw entry) of every namespace."""
        for key, raw in txn.cursor(db=self.index):
            yield bytes(key), bytes(raw)

    def log_since(self, txn: lmdb.Transaction, seq: int) -> list[tuple[list[bytes], list[bytes]]] | None:
        """The (removed, added) keys of every transaction after `seq`, oldest first; None if
        the log no longer reaches back to `seq + 1`."""
        cursor = txn.cursor(db=self.log)
        if not cursor.set_range(_BE.pack(seq + 1)) or bytes(cursor.key()) != _BE.pack(seq + 1):
            return None
        out = []
        for raw in cursor.iternext(keys=False):
            removed, added = msgpack.unpackb(bytes(raw))
            out.append((removed, added))
        return out

    def free_slots(self, txn: lmdb.Transaction) -> Iterator[tuple[int, int]]:
        for key in txn.cursor(db=self.free).iternext(values=False):
            yield _SLOT.unpack(bytes(key)[1:])

    def hwms(self, txn: lmdb.Transaction) -> dict[int, int]:
        """Slots handed out of each data file so far, by slot size."""
        out = {}
        cursor = txn.cursor(db=self.meta)
        if cursor.set_range(b"hwm"):
            for key, value in cursor:
                key = bytes(key)
                if not key.startswith(b"hwm") or len(key) != 11:
                    break
                out[_BE.unpack(key[3:])[0]] = _U64.unpack(bytes(value))[0]
        return out


class WriteBatch:
    """The index work of one write transaction: touches, evictions, slots, new entries.

    `finish()` writes the freed slots, the log record and the counters; it must run before
    the transaction commits. `removed` and `added` are the keys it logged.
    """

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self._ix, self._txn = index, txn
        self.tick = index.get_u64(txn, b"tick")
        self.used = index.get_u64(txn, b"used")
        self.seq = index.get_u64(txn, b"seq")
        self.gen = self.seq + 1  # the generation of entries written by this transaction
        self.removed: list[bytes] = []
        self.added: list[bytes] = []
        self._freed: list[tuple[int, int]] = []
        self._hwm: dict[int, int] = {}
        self.num_recount = 0

    def get(self, key: bytes) -> bytes | None:
        raw = self._txn.get(key, db=self._ix.index)
        return None if raw is None else bytes(raw)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make held keys most recently used, the last one most (a key listed twice counts
        where it is listed last); absent ones are skipped."""
        txn, ix = self._txn, self._ix
        for key in reversed(dict.fromkeys(reversed(keys))):  # each key once, at its last place
            raw = txn.get(key, db=ix.index)
            if raw is None or len(raw) < _ENTRY.size or raw[0] != _ENTRY_FORMAT:
                continue  # absent, or damaged: a reader finds it and deletes it
            raw = bytes(raw)
            old = _BE.pack(_U64.unpack_from(raw, _TICK_AT)[0])
            if txn.get(old, db=ix.order) == key:  # (a damaged tick must not unlink another block)
                txn.delete(old, db=ix.order)
            txn.put(_BE.pack(self.tick), key, db=ix.order)
            txn.put(key, raw[:_TICK_AT] + _U64.pack(self.tick) + raw[_TICK_AT + 8 :], db=ix.index)
            self.tick += 1

    def remove(self, key: bytes, *, damaged: bool = False) -> Entry | None:
        """Delete one entry; its slot becomes free when the transaction ends. Returns the
        entry (None if absent or unreadable).

        A `damaged` entry (or one that does not parse) frees no slot: the slot it names may
        be another block's. Its slot stays unused until `reclaim`, and the index's order and
        accounting are repaired when the transaction ends.
        """
        txn, ix = self._txn, self._ix
        raw = txn.get(key, db=ix.index)
        if raw is None:
            return None
        raw = bytes(raw)  # a buffer into the page would change under the delete
        txn.delete(key, db=ix.index)
        self.removed.append(key)
        try:
            e = unpack_entry(raw)
        except CorruptRecordError:
            self.num_recount += 1
            return None
        if damaged:
            self.num_recount += 1
            return e
        txn.delete(_BE.pack(e.tick), db=ix.order)
        self._freed.append((e.slot_bytes, e.slot))
        self.used = max(0, self.used - block_cost(e.slot_bytes))
        return e

    def evict(self, num_bytes: float) -> list[bytes]:
        """Remove least recently used entries (any namespace) until `num_bytes` are freed;
        return their keys."""
        txn, ix = self._txn, self._ix
        victims: list[bytes] = []
        stale: list[bytes] = []
        freed = 0
        if num_bytes <= 0:
            return victims
        for tick_key, key in txn.cursor(db=ix.order):
            if freed >= num_bytes:
                break
            raw = txn.get(key, db=ix.index)
            if raw is None:
                stale.append(bytes(tick_key))  # cannot happen unless the index was damaged
                continue
            with contextlib.suppress(CorruptRecordError):  # a damaged one goes too, freeing nothing known
                freed += block_cost(unpack_entry(raw).slot_bytes)
            victims.append(bytes(key))
        for tick_key in stale:
            txn.delete(tick_key, db=ix.order)
        for key in victims:
            self.remove(key)
        return victims

    def allocate(self, slot_bytes: int, count: int) -> list[int]:
        """`count` slots of one size: free ones first (lowest first), then new ones at the
        end of the file."""
        txn, ix = self._txn, self._ix
        slots: list[int] = []
        for kind in (b"u", b"p"):
            prefix = kind + _BE.pack(slot_bytes)
            cursor = txn.cursor(db=ix.free)
            found = cursor.set_range(prefix)
            while found and len(slots) < count:
                key = bytes(cursor.key())
                if not key.startswith(prefix):
                    break
                slots.append(_BE.unpack(key[9:])[0])
                found = cursor.delete()
        if len(slots) < count:
            hwm = self._hwm.get(slot_bytes)
            if hwm is None:
                hwm = ix.get_u64(txn, b"hwm" + _BE.pack(slot_bytes))
            need = count - len(slots)
            slots.extend(range(hwm, hwm + need))
            self._hwm[slot_bytes] = hwm + need
        slots.sort()
        return slots

    def unpunched(self) -> list[tuple[int, int]]:
        """Free slots whose space is still allocated (freed by earlier transactions); marks
        them given back. The caller punches them now, while it holds the writer lock."""
        txn, ix = self._txn, self._ix
        out = []
        cursor = txn.cursor(db=ix.free)
        found = cursor.set_range(b"u")
        while found:
            key = bytes(cursor.key())
            if not key.startswith(b"u"):
                break
            out.append(_SLOT.unpack(key[1:]))
            found = cursor.delete()
        for slot_bytes, slot in out:
            txn.put(b"p" + _SLOT.pack(slot_bytes, slot), b"", db=ix.free)
        return out

    def insert(self, key: bytes, entry: Entry, slot: int, xxh: int) -> None:
        """Add `entry` (a new block: not held) in `slot` with checksum `xxh`, most recently
        used."""
        txn, ix = self._txn, self._ix
        e = entry
        txn.put(key, pack_entry(e._replace(slot=slot, xxh=xxh, gen=self.gen, tick=self.tick)), db=ix.index)
        txn.put(_BE.pack(self.tick), key, db=ix.order)
        self.tick += 1
        self.used += block_cost(e.slot_bytes)
        self.added.append(key)

    def finish(self) -> None:
        txn, ix = self._txn, self._ix
        for slot_bytes, slot in self._freed:
            txn.put(b"u" + _SLOT.pack(slot_bytes, slot), b"", db=ix.free)
        for slot_bytes, hwm in self._hwm.items():
            ix.put_u64(txn, b"hwm" + _BE.pack(slot_bytes), hwm)
        if self.num_recount:
            self._repair()
            ix.put_u64(txn, b"leaked", ix.get_u64(txn, b"leaked") + self.num_recount)
        if self.removed or self.added:
            self.seq += 1
            txn.put(_BE.pack(self.seq), msgpack.packb([self.removed, self.added]), db=ix.log)
            if self.seq > LOG_KEEP:
                txn.delete(_BE.pack(self.seq - LOG_KEEP), db=ix.log)
            ix.put_u64(txn, b"seq", self.seq)
        ix.put_u64(txn, b"tick", self.tick)
        ix.put_u64(txn, b"used", self.used)


    def _repair(self) -> None:
        """After damaged entries were deleted: recount the bytes, drop order entries that no
        longer name their entry, give entries that lost theirs a fresh tick."""
        txn, ix = self._txn, self._ix
        entries = list(_sound(ix, txn))
        self.used = sum(block_cost(unpack_entry(raw).slot_bytes) for _, raw in entries)
        stale = [bytes(t) for t, k in txn.cursor(db=ix.order) if (r := txn.get(k, db=ix.index)) is None
                 or _tick_of(bytes(r)) != _BE.unpack(bytes(t))[0]]
        for tick_key in stale:
            txn.delete(tick_key, db=ix.order)
        for key, raw in entries:
            e = unpack_entry(raw)
            if txn.get(_BE.pack(e.tick), db=ix.order) != key:
                txn.put(_BE.pack(self.tick), key, db=ix.order)
                txn.put(key, pack_entry(e._replace(tick=self.tick)), db=ix.index)
                self.tick += 1

    def reclaim(self) -> int:
        """Return to the free list every slot below a file's high-water mark that no entry
        names and that is not free (left by deleted damaged entries); return how many."""
        txn, ix = self._txn, self._ix
        named = {(e.slot_bytes, e.slot) for e in (unpack_entry(raw) for _, raw in _sound(ix, txn))}
        free = set(ix.free_slots(txn))
        num = 0
        ix.put_u64(txn, b"leaked", 0)
        for slot_bytes, hwm in ix.hwms(txn).items():
            for slot in range(self._hwm.get(slot_bytes, hwm)):
                if (slot_bytes, slot) not in named and (slot_bytes, slot) not in free:
                    txn.put(b"u" + _SLOT.pack(slot_bytes, slot), b"", db=ix.free)
                    num += 1
        return num


def _tick_of(raw: bytes) -> int:
    try:
        return unpack_entry(raw).tick
    except CorruptRecordError:
        return -1


def _sound(ix: Index, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
    for key, raw in ix.entries(txn):
        try:
            unpack_entry(raw)
        except CorruptRecordError:
            continue
        yield key, raw
