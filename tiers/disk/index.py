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

The work of one write transaction is `tiers/disk/batch.py`.

Every record is parsed before it is used (`parse_*`, `unpack_entry`): one that does not
parse (a wrong length or prefix, a slot or size out of range, undecodable msgpack) is
damage. A write transaction drops it and notes it (counted and warned by `Index.note` once
the transaction commits); readers skip it. `tiers/disk/repair.py` checks the counters and
sweeps whole sub-databases.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator, Sequence
from itertools import takewhile
from operator import methodcaller
from typing import Any, NamedTuple, cast

import lmdb
import msgpack
import xxhash

from tiers.base import TierCounters
from tiers.disk.hashset import CompactHashSet
from tiers.errors import CorruptRecordError
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)

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
MAX_SLOT_BYTES = 1 << 36  # a slot size beyond any block's: damage
MAX_FILE_BYTES = 1 << 62  # a slot ending past this offset: damage
MAX_COUNT = 1 << 62  # ticks, sequence numbers, byte counts at or past this: damage


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
    if not valid_slot(slot_bytes, slot):
        raise CorruptRecordError(f"index entry names slot {slot} of {slot_bytes} bytes, out of range")
    rest = bytes(raw[_ENTRY.size :])
    return Entry(codec, layout, slot_bytes, slot, length, xxh, gen, tick, rest[:plen], rest[end:],
                 rest[plen:end] if known else None)


def raw_tick(raw: bytes) -> int | None:
    """The LRU tick of a raw entry, read without parsing it whole; None if it is too short
    or of another format (damaged)."""
    if len(raw) < _ENTRY.size or raw[0] != _ENTRY_FORMAT:
        return None
    tick: int = _U64.unpack_from(raw, _TICK_AT)[0]
    return tick


def with_tick(raw: bytes, tick: int) -> bytes:
    """A raw entry (`raw_tick` read it) with its LRU tick replaced."""
    return raw[:_TICK_AT] + _U64.pack(tick) + raw[_TICK_AT + 8 :]


def valid_slot(slot_bytes: int, slot: int) -> bool:
    """Whether a slot size is one the tier makes (a power of two from 16 bytes, or whole
    512-byte sectors) and the slot ends within `MAX_FILE_BYTES`."""
    return (16 <= slot_bytes <= MAX_SLOT_BYTES and (slot_bytes & (slot_bytes - 1) == 0 or slot_bytes % 512 == 0)
            and slot >= 0 and (slot + 1) * slot_bytes <= MAX_FILE_BYTES)


def free_key(kind: bytes, slot_bytes: int, slot: int) -> bytes:
    return kind + _SLOT.pack(slot_bytes, slot)


def parse_free(key: bytes) -> tuple[int, int] | None:
    """(slot size, slot) of a `free` key; None if it is not one."""
    if len(key) != 1 + _SLOT.size or key[:1] not in (b"u", b"p"):
        return None
    slot_bytes, slot = _SLOT.unpack(key[1:])
    return (slot_bytes, slot) if valid_slot(slot_bytes, slot) else None


def parse_u64(raw: bytes | memoryview | None) -> int | None:
    """A counter of `meta` (little-endian u64 below `MAX_COUNT`); None if absent or not one."""
    if raw is None or len(raw) != 8:
        return None
    value: int = _U64.unpack(raw)[0]
    return value if value < MAX_COUNT else None


def parse_be(key: bytes | memoryview) -> int | None:
    """An `order` tick or a `log` sequence number (big-endian u64 below `MAX_COUNT`); None if
    the key is not one."""
    if len(key) != 8:
        return None
    value: int = _BE.unpack(key)[0]
    return value if value < MAX_COUNT else None


def be_key(value: int) -> bytes:
    return _BE.pack(value)


def hwm_key(slot_bytes: int) -> bytes:
    return b"hwm" + _BE.pack(slot_bytes)


def parse_hwm_key(key: bytes) -> int | None:
    """The slot size of a `meta` high-water-mark key; None if it is not one."""
    if len(key) != 11 or not key.startswith(b"hwm"):
        return None
    slot_bytes: int = _BE.unpack(key[3:])[0]
    return slot_bytes if valid_slot(slot_bytes, 0) else None


def parse_log(raw: bytes | memoryview) -> tuple[list[bytes], list[bytes]] | None:
    """The (removed, added) index keys of a `log` record; None if it is not one."""
    try:
        record = msgpack.unpackb(bytes(raw))
    except Exception:  # msgpack raises many types on garbage
        return None
    if not (isinstance(record, list) and len(record) == 2 and all(
            isinstance(keys, list) and set(map(type, keys)) <= {bytes} for keys in record)):
        return None
    return record[0], record[1]


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
    """The sub-databases of one environment; every method runs inside the caller's txn.

    `counters.num_corrupt` counts the damaged records found through it (the tier shares the
    object); each is warned about, at most every few seconds."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.index, self.order, self.free, self.log, self.meta = (env.open_db(n) for n in DB_NAMES)
        self.counters = TierCounters()
        self._warn = RateLimitedWarning(logger)

    def note(self, damage: Sequence[str], count: int | None = None) -> None:
        """Count damage found (`count`, default one per item: each says what was done about
        it) and warn, at most every few seconds."""
        if not damage:
            return
        self.counters.num_corrupt += len(damage) if count is None else count
        more = f" (and {len(damage) - 1} more damaged records)" if len(damage) > 1 else ""
        self._warn(f"disk tier at {self.env.path()}: {damage[0]}{more}")

    def get_u64(self, txn: lmdb.Transaction, name: bytes) -> int:
        """A `meta` counter; 0 if absent or damaged (`disk_repair.settle` repairs those)."""
        return parse_u64(txn.get(name, db=self.meta)) or 0

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

    def hashes_of(self, txn: lmdb.Transaction, tag: bytes) -> CompactHashSet:
        """The block hashes of one namespace (its index keys less the tag) in one pass that
        runs no Python bytecode per key, into a compact set (already in order: nothing is
        sorted): a process opening a tier of 10^7 blocks spends its open here (`kvstrata
        bench scale-disk`). `txn` must not use buffers."""
        cursor = txn.cursor(db=self.index)
        if not cursor.last():
            return CompactHashSet()
        to_end = bytes(cursor.key()).startswith(tag)  # the last namespace: no per-key test needed
        if not cursor.set_range(tag):
            return CompactHashSet()
        keys = cast(Iterator[bytes], cursor.iternext(values=False))  # (no buffers: bytes)
        return CompactHashSet.from_keys(keys if to_end else takewhile(methodcaller("startswith", tag), keys),
                                        skip=len(tag), size_hint=int(txn.stat(self.index)["entries"]))

    def entries(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, raw entry) of every namespace."""
        for key, raw in txn.cursor(db=self.index):
            yield bytes(key), bytes(raw)

    def log_since(self, txn: lmdb.Transaction, seq: int) -> list[tuple[list[bytes], list[bytes]]] | None:
        """The (removed, added) keys of every transaction after `seq`, oldest first; None if
        the log no longer reaches back to `seq + 1`, or a record on the way is damaged (noted)."""
        cursor = txn.cursor(db=self.log)
        if not cursor.set_range(_BE.pack(seq + 1)) or bytes(cursor.key()) != _BE.pack(seq + 1):
            return None
        out: list[tuple[list[bytes], list[bytes]]] = []
        for key, raw in cursor:
            record = parse_log(raw)
            if parse_be(key) != seq + 1 + len(out) or record is None:
                self.note([f"change-log record {bytes(key).hex()} is damaged (the in-memory index is rebuilt)"])
                return None
            out.append(record)
        return out

    def free_slots(self, txn: lmdb.Transaction) -> Iterator[tuple[int, int]]:
        """(slot size, slot) of every well-formed `free` record."""
        for key in txn.cursor(db=self.free).iternext(values=False):
            slot = parse_free(bytes(key))
            if slot is not None:
                yield slot

    def hwms(self, txn: lmdb.Transaction) -> dict[int, int]:
        """Slots handed out of each data file so far, by slot size (well-formed records only)."""
        out = {}
        cursor = txn.cursor(db=self.meta)
        if cursor.set_range(b"hwm"):
            for key, value in cursor:
                key = bytes(key)
                if not key.startswith(b"hwm"):
                    break
                slot_bytes, hwm = parse_hwm_key(key), parse_u64(value)
                if slot_bytes is not None and hwm is not None and valid_slot(slot_bytes, max(0, hwm - 1)):
                    out[slot_bytes] = hwm
        return out
