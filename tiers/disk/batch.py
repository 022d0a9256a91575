"""The index work of one write transaction of the disk tier (`tiers/disk/index.py` has the
format). Slots it frees enter `free` only when it ends, so a transaction never overwrites a
slot that an entry it may yet roll back (a killed process, a full disk) still names.

Each record it reads is parsed first: one that does not parse, or that contradicts the
records it points to, is damage, dropped and listed in `damage` (noted once the transaction
commits).
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb
import msgpack

from tiers.disk.index import (
    LOG_KEEP,
    Entry,
    Index,
    be_key,
    block_cost,
    free_key,
    hwm_key,
    pack_entry,
    parse_be,
    parse_free,
    raw_tick,
    unpack_entry,
    with_tick,
)
from tiers.errors import CorruptRecordError


def delete(cursor: lmdb.Cursor) -> bool:
    """Delete the record under `cursor`; whether the cursor now stands on the next one."""
    cursor.delete()
    return bool(cursor.key())  # LMDB keys are never empty: b"" means past the end


class WriteBatch:
    """The index work of one write transaction: touches, evictions, slots, new entries.

    `finish()` writes the freed slots, the log record and the counters; it must run before
    the transaction commits (after `disk_repair.repair` where `needs_repair`). `removed` and
    `added` are the keys it logged; `damage` what it found damaged and dropped, to be noted
    once it commits.
    """

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self.ix, self.txn = index, txn
        self.tick = index.get_u64(txn, b"tick")
        self.used = index.get_u64(txn, b"used")
        self.seq = index.get_u64(txn, b"seq")
        self.gen = self.seq + 1  # the generation of entries written by this transaction
        self.removed: list[bytes] = []
        self.added: list[bytes] = []
        self.damage: list[str] = []
        self.hwm: dict[int, int] = {}  # high-water marks this transaction moved
        self._freed: list[tuple[int, int]] = []
        self.num_leaked = 0  # slots left neither named nor free (for `disk_repair.reclaim`)
        self.needs_repair = False  # the order or the accounting may be off (`disk_repair.repair`)

    def get(self, key: bytes) -> bytes | None:
        raw = self.txn.get(key, db=self.ix.index)
        return None if raw is None else bytes(raw)

    def drop(self, cursor: lmdb.Cursor, what: str) -> bool:
        """Delete the record under `cursor`, noting it as damage; whether a record follows."""
        self.damage.append(f"{what}; dropped")
        return delete(cursor)

    def hwm_of(self, slot_bytes: int) -> int:
        hwm = self.hwm.get(slot_bytes)
        return self.ix.get_u64(self.txn, hwm_key(slot_bytes)) if hwm is None else hwm

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make held keys most recently used, the last one most (a key listed twice counts
        where it is listed last); absent ones are skipped."""
        txn, ix = self.txn, self.ix
        for key in reversed(dict.fromkeys(reversed(keys))):  # each key once, at its last place
            raw = txn.get(key, db=ix.index)
            tick = None if raw is None else raw_tick(bytes(raw))
            if raw is None or tick is None:
                continue  # absent, or damaged: a reader finds it and deletes it
            old = be_key(tick)
            if txn.get(old, db=ix.order) == key:  # (a damaged tick must not unlink another block)
                txn.delete(old, db=ix.order)
            txn.put(be_key(self.tick), key, db=ix.order)
            txn.put(key, with_tick(bytes(raw), self.tick), db=ix.index)
            self.tick += 1

    def remove(self, key: bytes, *, damaged: bool = False) -> Entry | None:
        """Delete one entry; its slot becomes free when the transaction ends. Returns the
        entry (None if absent or unreadable).

        A `damaged` entry (or one that does not parse, or whose LRU order record does not name
        it: damage too) frees no slot: the slot it names may be another block's. Its slot
        stays unused until `disk_repair.reclaim`, and the order and accounting are repaired
        when the transaction ends.
        """
        txn, ix = self.txn, self.ix
        raw = txn.get(key, db=ix.index)
        if raw is None:
            return None
        raw = bytes(raw)  # a buffer into the page would change under the delete
        txn.delete(key, db=ix.index)
        self.removed.append(key)
        try:
            e = unpack_entry(raw)
        except CorruptRecordError:
            self.num_leaked += 1
            self.needs_repair = True
            return None
        if not damaged and txn.get(be_key(e.tick), db=ix.order) != key:
            self.damage.append(f"block {key.hex()}: no LRU order record names its entry; deleted, its slot left "
                               "unused until reclaimed")
            damaged = True
        if damaged:
            self.num_leaked += 1
            self.needs_repair = True
            return e
        txn.delete(be_key(e.tick), db=ix.order)
        self._forget(e)
        return e

    def _forget(self, e: Entry) -> None:
        """A sound entry was deleted with its order record: its slot becomes free when the
        transaction ends, its bytes leave the account."""
        self._freed.append((e.slot_bytes, e.slot))
        self.used = max(0, self.used - block_cost(e.slot_bytes))

    def evict(self, num_bytes: float) -> list[bytes]:
        """Remove least recently used entries (any namespace) until `num_bytes` are freed;
        return their keys. Order records that do not parse or name no entry of their tick are
        damage: dropped. A sound victim is deleted where the order's cursor finds it (the
        entry already read, its order record under the cursor); a damaged one by `remove`."""
        txn, ix = self.txn, self.ix
        victims: list[bytes] = []
        damaged: list[bytes] = []
        freed = 0
        if num_bytes <= 0:
            return victims
        cursor = txn.cursor(db=ix.order)
        found = cursor.first()
        while found and freed < num_bytes:
            tick, key = parse_be(cursor.key()), bytes(cursor.value())
            raw = None if tick is None else txn.get(key, db=ix.index)
            if raw is None:
                found = self.drop(cursor, f"LRU order record {bytes(cursor.key()).hex()} is damaged or names no block")
                continue
            try:
                e = unpack_entry(raw)
            except CorruptRecordError:  # a damaged entry goes too, freeing nothing known
                damaged.append(key)
                found = cursor.next()
                continue
            if e.tick != tick:
                self.needs_repair = True  # the entry may have lost its own order record
                found = self.drop(cursor, f"LRU order record {tick} names block {key.hex()} of another tick")
                continue
            freed += block_cost(e.slot_bytes)
            victims.append(key)
            txn.delete(key, db=ix.index)
            self.removed.append(key)
            self._forget(e)
            found = delete(cursor)
        damaged = list(dict.fromkeys(damaged))  # a damaged entry may be named twice
        for key in damaged:
            self.remove(key)
        return victims + damaged

    def allocate(self, slot_bytes: int, count: int) -> list[int]:
        """`count` slots of one size: free ones first (lowest first), then new ones at the
        end of the file. Free records that do not parse, lie past the file's high-water mark
        or carry a value are damage: dropped."""
        txn, ix = self.txn, self.ix
        hwm = self.hwm_of(slot_bytes)
        slots: list[int] = []
        taken: set[int] = set()  # (a slot both `u` and `p` is damage)
        for kind in (b"u", b"p"):
            prefix = kind + be_key(slot_bytes)
            cursor = txn.cursor(db=ix.free)
            found = cursor.set_range(prefix)
            while found and len(slots) < count:
                key = bytes(cursor.key())
                if not key.startswith(prefix):
                    break
                where = parse_free(key)
                if where is None or where[1] >= hwm or where[1] in taken or len(cursor.value()):
                    self.num_leaked += where is not None and len(cursor.value()) > 0
                    found = self.drop(cursor, f"free-slot record {key.hex()} is damaged")
                    continue
                slots.append(where[1])
                taken.add(where[1])
                found = delete(cursor)
        if len(slots) < count:
            need = count - len(slots)
            slots.extend(range(hwm, hwm + need))
            self.hwm[slot_bytes] = hwm + need
        slots.sort()
        return slots

    def unpunched(self) -> list[tuple[int, int]]:
        """Free slots whose space is still allocated (freed by earlier transactions); marks
        them given back. The caller punches them now, while it holds the writer lock. Damaged
        records (as `allocate` sees them) are dropped, not punched."""
        txn, ix = self.txn, self.ix
        out = []
        hwms: dict[int, int] = {}
        cursor = txn.cursor(db=ix.free)
        found = cursor.set_range(b"u")
        while found:
            key = bytes(cursor.key())
            if not key.startswith(b"u"):
                break
            where = parse_free(key)
            if where is not None and where[0] not in hwms:
                hwms[where[0]] = self.hwm_of(where[0])
            if where is None or where[1] >= hwms[where[0]] or len(cursor.value()):
                self.num_leaked += where is not None and len(cursor.value()) > 0
                found = self.drop(cursor, f"free-slot record {key.hex()} is damaged")
                continue
            out.append(where)
            found = delete(cursor)
        for slot_bytes, slot in out:
            txn.put(free_key(b"p", slot_bytes, slot), b"", db=ix.free)
        return out

    def insert(self, key: bytes, entry: Entry, slot: int, xxh: int) -> None:
        """Add `entry` (a new block: not held) in `slot` with checksum `xxh`, most recently
        used."""
        txn, ix = self.txn, self.ix
        e = entry
        txn.put(key, pack_entry(e._replace(slot=slot, xxh=xxh, gen=self.gen, tick=self.tick)), db=ix.index)
        txn.put(be_key(self.tick), key, db=ix.order)
        self.tick += 1
        self.used += block_cost(e.slot_bytes)
        self.added.append(key)

    def finish(self) -> None:
        txn, ix = self.txn, self.ix
        for slot_bytes, slot in self._freed:
            txn.put(free_key(b"u", slot_bytes, slot), b"", db=ix.free)
        for slot_bytes, hwm in self.hwm.items():
            ix.put_u64(txn, hwm_key(slot_bytes), hwm)
        if self.num_leaked:
            ix.put_u64(txn, b"leaked", ix.get_u64(txn, b"leaked") + self.num_leaked)
        if self.removed or self.added:
            self.seq += 1
            txn.put(be_key(self.seq), msgpack.packb([self.removed, self.added]), db=ix.log)
            if self.seq > LOG_KEEP:
                txn.delete(be_key(self.seq - LOG_KEEP), db=ix.log)
            ix.put_u64(txn, b"seq", self.seq)
        ix.put_u64(txn, b"tick", self.tick)
        ix.put_u64(txn, b"used", self.used)
