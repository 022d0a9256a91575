"""Damaged records of the disk tier's index: the counters a write transaction starts from,
checked and rebuilt; whole sub-databases swept (a scrub); the order and accounting repaired
after damaged entries go; slots no entry names freed again.

Every function runs inside a `WriteBatch`'s write transaction. What it finds damaged it drops
and lists in `WriteBatch.damage` (noted once the transaction commits): records that do not
parse, a counter that contradicts the records it counts, a free slot that a block names.
Recomputed counters only ever move forwards (ticks, sequence numbers, high-water marks), so
no slot a block names is handed out again and every process's in-memory index notices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lmdb
import msgpack

from tiers.disk.batch import WriteBatch
from tiers.disk.files import SlotFiles
from tiers.disk.index import (
    FORMAT,
    LOG_KEEP,
    Entry,
    Index,
    be_key,
    block_cost,
    free_key,
    hwm_key,
    ns_tag,
    pack_entry,
    parse_be,
    parse_free,
    parse_hwm_key,
    parse_log,
    parse_u64,
    unpack_entry,
    valid_slot,
)
from tiers.errors import CorruptRecordError


def recover(ix: Index, txn: lmdb.Transaction) -> list[str]:
    """At open: settle every counter (`settle(full=True)`) and, if damaged entries left
    slots unnamed, reclaim them. Returns the damage found (the caller notes it once the
    transaction commits)."""
    wb = WriteBatch(ix, txn)
    settle(wb, full=True)
    finish(wb)
    if ix.get_u64(txn, b"leaked"):
        reclaim(wb)
    return wb.damage


def finish(wb: WriteBatch) -> None:
    """Repair the order and accounting if the transaction found damage, then `wb.finish()`."""
    if wb.needs_repair:
        repair(wb)
    wb.finish()


def settle(wb: WriteBatch, *, full: bool = False) -> None:
    """Check the counters `wb` starts from against the records they count, rebuilding the
    damaged ones: the LRU tick must lie past every order record, the sequence number at or
    past every log record, the accounted bytes and each high-water mark must parse. With
    `full` (an open, a scrub): also the format, `leaked`, the namespace records, and a data
    file whose high-water mark is missing."""
    _settle_tick(wb)
    _settle_seq(wb)
    _settle_hwms(wb, full)
    _settle_used(wb)
    if full:
        _settle_meta(wb)


def _last(wb: WriteBatch, db: Any, what: str) -> int:
    """The last tick or sequence number of `order` or `log` (-1 if empty), damaged keys at
    the end dropped."""
    cursor = wb.txn.cursor(db=db)
    while cursor.last():
        value = parse_be(cursor.key())
        if value is not None:
            return value
        wb.drop(cursor, f"{what} record {bytes(cursor.key()).hex()} is damaged")
    return -1


def _settle_tick(wb: WriteBatch) -> None:
    raw = wb.txn.get(b"tick", db=wb.ix.meta)
    tick, last = parse_u64(raw), _last(wb, wb.ix.order, "LRU order")
    if (tick is not None and tick > last) or (raw is None and last < 0):
        return
    wb.damage.append(f"its LRU tick ({'missing' if raw is None else 'damaged' if tick is None else tick}) "
                     f"is not past the last order record's ({last}); moved past it")
    wb.tick = last + 1


def _settle_seq(wb: WriteBatch) -> None:
    txn, ix = wb.txn, wb.ix
    raw = txn.get(b"seq", db=ix.meta)
    seq, last = parse_u64(raw), _last(wb, ix.log, "change-log")
    if (seq is not None and seq >= last) or (raw is None and last < 0):
        return
    state = "missing" if raw is None else "damaged" if seq is None else seq
    wb.damage.append(f"its change-log sequence number ({state}) is behind the log's last record ({last}); "
                     "the log is dropped")
    wb.seq = max(last, seq or 0) + LOG_KEEP + 1  # past every position a process holds: each rebuilds
    wb.gen = wb.seq + 1
    txn.drop(ix.log, delete=False)
    ix.put_u64(txn, b"seq", wb.seq)


def _settle_used(wb: WriteBatch) -> None:
    txn, ix = wb.txn, wb.ix
    raw = txn.get(b"used", db=ix.meta)
    used = parse_u64(raw)
    if (used is not None and used % 16 == 0) or (raw is None and not txn.stat(ix.index)["entries"]):
        return  # (slot sizes and the index share are multiples of 16)
    wb.damage.append(f"its accounted bytes are {'missing' if raw is None else 'damaged'}; recounted")
    wb.used = sum(block_cost(e.slot_bytes) for _, e in _sound(ix, txn))


def _settle_hwms(wb: WriteBatch, full: bool) -> None:
    """Drop damaged high-water-mark keys; recompute damaged values (and, with `full`, missing
    ones of data files that hold bytes) past every slot a block or free record names and past
    the file's end. Slots below a recomputed mark that nothing names are reclaimed later."""
    txn, ix = wb.txn, wb.ix
    cursor = txn.cursor(db=ix.meta)
    found = cursor.set_range(b"hwm")
    seen: set[int] = set()
    redo: dict[int, bool] = {}  # slot size -> whether its record was damaged (else missing)
    while found and bytes(cursor.key()).startswith(b"hwm"):
        key = bytes(cursor.key())
        slot_bytes = parse_hwm_key(key)
        if slot_bytes is None:
            found = wb.drop(cursor, f"high-water-mark record {key!r} is damaged")
            continue
        seen.add(slot_bytes)
        hwm = parse_u64(cursor.value())
        if hwm is None or not valid_slot(slot_bytes, max(0, hwm - 1)):
            redo[slot_bytes] = True
        found = cursor.next()
    files = SlotFiles(ix.env.path()).file_sizes() if full or redo else {}
    for slot_bytes, size in files.items():
        if full and size and slot_bytes not in seen and valid_slot(slot_bytes, 0):
            redo[slot_bytes] = False
    if not redo:
        return
    named: dict[int, int] = {}
    for slot_bytes, slot in [(e.slot_bytes, e.slot) for _, e in _sound(ix, txn)] + list(ix.free_slots(txn)):
        named[slot_bytes] = max(named.get(slot_bytes, 0), slot + 1)
    for slot_bytes, damaged in redo.items():
        if damaged or named.get(slot_bytes):  # (missing with nothing named: a write that never committed)
            what = "damaged" if damaged else "missing"
            wb.damage.append(f"the high-water mark of {slot_bytes}-byte slots is {what}; recomputed")
        hwm = max(named.get(slot_bytes, 0), -(-files.get(slot_bytes, 0) // slot_bytes))
        ix.put_u64(txn, hwm_key(slot_bytes), hwm)
        wb.num_leaked += 1  # slots below it that nothing names: freed by `reclaim`


def _settle_meta(wb: WriteBatch) -> None:
    """`format` (rewritten if it is not a number), `leaked`, and the `ns:` records (dropped
    unless they are msgpack maps naming their namespace's tag; a store rewrites its own)."""
    txn, ix = wb.txn, wb.ix
    fmt = txn.get(b"format", db=ix.meta)
    if fmt is None or not bytes(fmt).isdigit():
        if fmt is not None:
            wb.damage.append(f"its format record {bytes(fmt)[:16]!r} is damaged; rewritten")
        txn.put(b"format", FORMAT, db=ix.meta)
    raw = txn.get(b"leaked", db=ix.meta)
    if raw is not None and parse_u64(raw) is None:
        wb.damage.append("its count of unnamed slots is damaged; they are reclaimed")
        txn.delete(b"leaked", db=ix.meta)
        wb.num_leaked += 1
    cursor = txn.cursor(db=ix.meta)
    found = cursor.set_range(b"ns:")
    while found and bytes(cursor.key()).startswith(b"ns:"):
        key = bytes(cursor.key())
        try:
            record = msgpack.unpackb(bytes(cursor.value()), raw=False)
        except Exception:  # msgpack raises many types on garbage
            record = None
        if isinstance(record, dict) and record.get("tag") == ns_tag(key[3:]):
            found = cursor.next()
        else:
            found = wb.drop(cursor, f"namespace record {key[3:]!r} is damaged")


def sweep(wb: WriteBatch) -> None:
    """A scrub's pass over `order`, `free` and `log` (after `settle(full=True)`): drop every
    record that does not parse, an order record naming no entry of its tick, a free record
    that carries a value, lies past its file's high-water mark or repeats another, and a log
    record that does not decode. The order and accounting are repaired when `wb` finishes."""
    txn, ix = wb.txn, wb.ix
    wb.needs_repair = True
    cursor = txn.cursor(db=ix.order)
    found = cursor.first()
    while found:
        tick, key = parse_be(cursor.key()), bytes(cursor.value())
        raw = None if tick is None else txn.get(key, db=ix.index)
        if raw is None or _tick_of(bytes(raw)) not in (tick, -1):  # (-1: a damaged entry, deleted with its record)
            found = wb.drop(cursor, f"LRU order record {bytes(cursor.key()).hex()} is damaged or names no block")
        else:
            found = cursor.next()
    hwms = ix.hwms(txn)
    seen: set[tuple[int, int]] = set()
    cursor = txn.cursor(db=ix.free)
    found = cursor.first()
    while found:
        where = parse_free(bytes(cursor.key()))
        if where is None or where in seen or where[1] >= wb.hwm.get(where[0], hwms.get(where[0], 0)) or len(
                cursor.value()):
            wb.num_leaked += where is not None
            found = wb.drop(cursor, f"free-slot record {bytes(cursor.key()).hex()} is damaged")
        else:
            seen.add(where)
            found = cursor.next()
    cursor = txn.cursor(db=ix.log)
    found = cursor.first()
    while found:
        if parse_be(cursor.key()) is None or parse_log(cursor.value()) is None:
            found = wb.drop(cursor, f"change-log record {bytes(cursor.key()).hex()} is damaged")
        else:
            found = cursor.next()


def repair(wb: WriteBatch) -> None:
    """After damaged entries or order records were deleted: recount the bytes, drop order
    records that no longer name their entry, give entries that lost theirs a fresh tick."""
    txn, ix = wb.txn, wb.ix
    entries = list(_sound(ix, txn))
    wb.used = sum(block_cost(e.slot_bytes) for _, e in entries)
    stale = []
    for t, k in txn.cursor(db=ix.order):
        tick, raw = parse_be(t), txn.get(k, db=ix.index)
        if tick is None:
            wb.damage.append(f"LRU order record {bytes(t).hex()} is damaged; dropped")
        if tick is None or raw is None or _tick_of(bytes(raw)) != tick:
            stale.append(bytes(t))
    for tick_key in stale:
        txn.delete(tick_key, db=ix.order)
    for key, e in entries:
        if txn.get(be_key(e.tick), db=ix.order) != key:
            txn.put(be_key(wb.tick), key, db=ix.order)
            txn.put(key, pack_entry(e._replace(tick=wb.tick)), db=ix.index)
            wb.tick += 1
    wb.needs_repair = False


def reclaim(wb: WriteBatch) -> int:
    """Return to the free list every slot below a file's high-water mark that no entry names
    and that is not free (left by deleted damaged entries); drop free records naming a slot
    an entry names (damage). Returns how many slots it freed."""
    txn, ix = wb.txn, wb.ix
    named = {(e.slot_bytes, e.slot) for _, e in _sound(ix, txn)}
    free: set[tuple[int, int]] = set()
    cursor = txn.cursor(db=ix.free)
    found = cursor.first()
    while found:
        where = parse_free(bytes(cursor.key()))
        if where is not None and where in named:
            found = wb.drop(cursor, f"free-slot record {bytes(cursor.key()).hex()} names a held block's slot")
            continue
        if where is not None:
            free.add(where)
        found = cursor.next()
    num = 0
    ix.put_u64(txn, b"leaked", 0)
    for slot_bytes, hwm in ix.hwms(txn).items():
        for slot in range(wb.hwm.get(slot_bytes, hwm)):
            if (slot_bytes, slot) not in named and (slot_bytes, slot) not in free:
                txn.put(free_key(b"u", slot_bytes, slot), b"", db=ix.free)
                num += 1
    return num


def _tick_of(raw: bytes) -> int:
    try:
        return unpack_entry(raw).tick
    except CorruptRecordError:
        return -1


def _sound(ix: Index, txn: lmdb.Transaction) -> Iterator[tuple[bytes, Entry]]:
    for key, raw in ix.entries(txn):
        try:
            yield key, unpack_entry(raw)
        except CorruptRecordError:
            continue
