"""Whole-index passes of the disk tier: the checks of a directory before it is opened,
integrity, scrub, roots-first enumeration, wipe, and the per-namespace summary `kvstrata
inspect` prints (`summarize`, read-only)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lmdb
import msgpack
import numpy as np

from tiers.base import ScrubResult
from tiers.disk.codec import DiskCodec
from tiers.disk.env import _ENVS, TruncatedIndexError, begin, open_read_only
from tiers.disk.files import SlotFiles, file_name
from tiers.disk.index import (
    DB_NAMES,
    FORMAT,
    OLD_DB_NAMES,
    TAG_BYTES,
    Entry,
    Index,
    block_cost,
    ns_tag,
    unpack_entry,
)
from tiers.disk.mirror import Mirror
from tiers.disk.payload import payload_sum
from tiers.errors import ConfigError, CorruptRecordError, UnverifiableRecordError
from tiers.keys import BlockHash, BlockKey

unpack = unpack_entry
_BE_TICK = 8


def open_index(env: lmdb.Environment, path: str) -> Index:
    """The index of the disk tier at `path` (its sub-databases created if new). Raises
    `ConfigError`, having created nothing, for an LMDB store that is not kvstrata's, a disk
    tier of the first format, or one of a format this version does not read. A format
    record that is not a number is damage: noted (the tier rewrites it)."""
    with begin(env) as txn:
        names = {bytes(k) for k in txn.cursor().iternext(values=False)}
    if names - set(DB_NAMES) and not set(OLD_DB_NAMES) <= names:  # checked before anything is created
        raise ConfigError(f"disk_path {path!r} holds an LMDB store that is not kvstrata's (its keys include "
                          f"{sorted(names - set(DB_NAMES))[:3]}); nothing was changed")
    if set(OLD_DB_NAMES) <= names:
        raise ConfigError(
            f"disk_path {path!r} holds a disk tier in kvstrata's first on-disk format (block records inside "
            "LMDB), which this version does not read; nothing was changed. Use another disk_path, or move "
            "that directory away (or delete it) to start an empty disk tier there")
    try:
        ix = Index(env)
    except lmdb.Error as exc:  # a key of ours that is no sub-database: not our store
        raise ConfigError(f"disk_path {path!r} holds an LMDB store that is not kvstrata's: {exc}") from None
    with begin(env) as txn:
        fmt = txn.get(b"format", db=ix.meta)
    if fmt is not None and bytes(fmt) != FORMAT:
        if not bytes(fmt).isdigit():
            ix.note([f"its format record {bytes(fmt)[:16]!r} is damaged; rewritten"])
            return ix
        raise ConfigError(f"disk_path {path!r} holds a disk tier of format {bytes(fmt)[:16]!r}, which this version "
                          f"of kvstrata does not read (it reads {FORMAT!r}); use another disk_path")
    return ix


def same_entry(env: lmdb.Environment, ix: Index, key: bytes, e: Entry) -> bool:
    """Whether `key` still names the payload `e` names (else it was evicted or rewritten
    since `e` was read: a failed read of it was a race, not damage)."""
    with begin(env, db=ix.index, buffers=True) as txn:
        raw = txn.get(key)
        if raw is None:
            return False
        try:
            cur = unpack_entry(raw)
        except CorruptRecordError:
            return True  # the entry itself is damaged now
    return (cur.gen, cur.slot_bytes, cur.slot, cur.xxh) == (e.gen, e.slot_bytes, e.slot, e.xxh)


def payload_sound(files: SlotFiles, key: bytes, e: Entry, buffers: dict[int, np.ndarray] | None = None) -> bool:
    """Whether the payload `e` names is whole and passes its checksum (read into one of
    `buffers`, by slot size, where given)."""
    buf = None if buffers is None else buffers.get(e.slot_bytes)
    if buf is None:
        buf = np.empty(e.slot_bytes, dtype=np.uint8)
        if buffers is not None:
            buffers[e.slot_bytes] = buf
    payload = buf[: e.length]
    return files.read(e.slot_bytes, e.slot, [payload]) == e.length and payload_sum(key, e, [payload]) == e.xxh


def held_keys(env: lmdb.Environment, ix: Index, tag: bytes) -> tuple[list[BlockKey], int]:
    """One namespace's blocks whose entries carry token ids, parent and extras, as keys, each
    after its parent (blocks whose parent is not held come first), from one snapshot; and how
    many of the namespace's blocks lack any of the three."""
    n = len(tag)
    items: dict[BlockHash, BlockKey] = {}
    num_without = 0
    with begin(env, buffers=True) as txn:
        for key in ix.keys_of(txn, tag):
            try:
                e = unpack_entry(txn.get(key, db=ix.index))
            except CorruptRecordError:
                continue
            if not (e.tokens and e.parent and e.extras is not None):
                num_without += 1
                continue
            h = BlockHash(key[n:])
            items[h] = BlockKey(h, e.tokens, e.parent, e.extras)
    children: dict[bytes, list[BlockHash]] = {}
    queue: deque[BlockHash] = deque()
    for h, k in items.items():
        if k.parent in items and k.parent != h:
            children.setdefault(bytes(k.parent or b""), []).append(h)
        else:
            queue.append(h)
    out: list[BlockKey] = []
    seen: set[BlockHash] = set()
    while queue:
        h = queue.popleft()
        seen.add(h)
        out.append(items[h])
        queue.extend(c for c in children.get(h, ()) if c not in seen)
    out.extend(items[h] for h in items if h not in seen)  # a cycle: only by damage
    return out, num_without


def check_integrity(env: lmdb.Environment, ix: Index, mirror: Mirror, tag: bytes) -> None:
    """Raise `RuntimeError` (a bug) unless, in one snapshot: every entry is in the LRU order
    and the order holds nothing else, no slot is named twice or both named and free, every
    slot lies below its file's high-water mark, the accounted bytes match the entries, and
    this process's in-memory copy matches the namespace's keys."""
    with begin(env) as txn:
        hwm = ix.hwms(txn)
        free = set(ix.free_slots(txn))
        used = ix.get_u64(txn, b"used")
        total = num_entries = 0
        sound = True
        slots: set[tuple[int, int]] = set()
        for key, raw in ix.entries(txn):
            num_entries += 1
            try:
                e = unpack_entry(raw)
            except CorruptRecordError:
                sound = False  # damage, deleted when read; not an invariant of the code
                continue
            total += block_cost(e.slot_bytes)
            if txn.get(e.tick.to_bytes(_BE_TICK, "big"), db=ix.order) != key:
                raise RuntimeError(f"disk tier: block {key.hex()} missing from the LRU order (a bug)")
            where = (e.slot_bytes, e.slot)
            if where in slots or where in free:
                raise RuntimeError(f"disk tier: slot {where} named twice or named and free (a bug)")
            if e.slot >= hwm.get(e.slot_bytes, 0):
                raise RuntimeError(f"disk tier: slot {where} beyond its file's high-water mark (a bug)")
            slots.add(where)
        num_order = int(txn.stat(ix.order)["entries"])
        if num_order != num_entries:
            raise RuntimeError(f"disk tier: {num_entries} entries but {num_order} in the LRU order (a bug)")
        if any(s >= hwm.get(size, 0) for size, s in free):
            raise RuntimeError("disk tier: a free slot beyond its file's high-water mark (a bug)")
        if sound and total != used:
            raise RuntimeError(f"disk tier: accounted {used} bytes, entries take {total} (a bug)")
        mirror.check(txn)


def scrub(env: lmdb.Environment, ix: Index, files: SlotFiles, tag: bytes,
          codec: DiskCodec) -> tuple[ScrubResult, list[tuple[bytes, int | None]]]:
    """Verify every entry and payload (as stored, whatever its codec) of one snapshot, and
    this namespace's entries against its layout; return the counts and the damaged (key,
    generation) pairs for the caller to delete (a generation: only if unchanged). A sound
    payload this reader does not decode (`DiskCodec.check`) is not damage."""
    with begin(env) as txn:
        items = list(ix.entries(txn))
    ends = files.file_sizes()  # (after the snapshot: every payload it names was written before)
    num_ok = num_foreign = 0
    damaged: list[tuple[bytes, int | None]] = []
    buffers: dict[int, np.ndarray] = {}
    for key, raw in items:
        try:
            e = unpack_entry(raw)
        except CorruptRecordError:
            damaged.append((key, None))
            continue
        own = key[:TAG_BYTES] == tag
        sound = e.slot * e.slot_bytes + e.length <= ends.get(e.slot_bytes, 0) and payload_sound(files, key, e, buffers)
        if sound and own:
            try:
                codec.check(e)
            except UnverifiableRecordError:
                pass  # sound, in a form this reader does not decode: left alone
            except CorruptRecordError:
                sound = False
        if not sound:
            damaged.append((key, e.gen))
        elif own:
            num_ok += 1
        else:
            num_foreign += 1
    return ScrubResult(num_ok, len(damaged), num_foreign), damaged


def wipe(ix: Index, txn: lmdb.Transaction, log_keep: int) -> None:
    """Delete every entry, slot and log record of every namespace (the caller empties the
    data files before committing). Every process's in-memory copy rebuilds (the log position
    it holds no longer exists)."""
    seq = ix.get_u64(txn, b"seq")
    for db in (ix.index, ix.order, ix.free, ix.log):
        txn.drop(db, delete=False)
    hwm_keys = [bytes(k) for k in txn.cursor(db=ix.meta).iternext(values=False) if bytes(k).startswith(b"hwm")]
    for key in hwm_keys:
        txn.delete(key, db=ix.meta)
    ix.put_u64(txn, b"seq", seq + log_keep + 1)
    ix.put_u64(txn, b"used", 0)


@contextmanager
def _read_only_index(path: str) -> Iterator[tuple[lmdb.Environment, Any]]:
    """The index under `path`, read-only: this process's open environment if it has one,
    else a read-only open checked as the store checks its own (`open_read_only`). Raises
    `ConfigError` naming the problem if `path` holds no kvstrata disk tier this version reads."""
    real = os.path.realpath(path)
    shared = _ENVS.find(real)
    if shared is not None:
        yield shared, [shared.open_db(n) for n in DB_NAMES]
        return
    env = open_read_only(path)
    try:
        try:
            with env.begin() as txn:
                old = all(txn.get(name) is not None for name in OLD_DB_NAMES)
            if old:
                raise ConfigError(f"{path!r} holds a disk tier in kvstrata's first on-disk format, which this "
                                  "version does not read")
            dbs = [env.open_db(n, create=False) for n in DB_NAMES]
            with env.begin() as txn:
                fmt = txn.get(b"format", db=dbs[-1])
        except lmdb.Error as exc:
            raise ConfigError(f"{path!r} is an LMDB environment but not a kvstrata disk tier ({exc})") from None
        if fmt is not None and bytes(fmt) != FORMAT:
            raise ConfigError(f"{path!r} holds a disk tier of format {bytes(fmt)[:40]!r}, which this version of "
                              f"kvstrata does not read (it reads {FORMAT!r})")
        yield env, dbs
    finally:
        env.close()


def _space(name: str) -> dict[str, Any]:
    return {"namespace": name, "identity": None, "capacity_bytes": None, "blocks": 0, "bytes": 0,
            "damaged_blocks": 0, "oldest_tick": None, "newest_tick": None}


def _namespace_record(key: bytes, value: bytes, damage: list[dict[str, str]]) -> tuple[bytes, dict[str, Any]]:
    """The tag and summary of one `ns:` record of the meta database, its damage noted (the
    tag is recomputed from the namespace, so its blocks count under it whatever the record holds)."""
    namespace = key[3:]
    space, tag = _space(namespace.hex()), ns_tag(namespace)
    where = f"namespace {namespace.hex()}"
    try:
        entry = msgpack.unpackb(value, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # some carry no text
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        damage.append({"where": where, "what": f"its record is not msgpack ({why})"[:300]})
        return tag, space
    if not isinstance(entry, dict):
        damage.append({"where": where, "what": f"its record is a {type(entry).__name__}, not a map"})
        return tag, space
    space["identity"] = entry.get("identity")
    named = entry.get("tag")
    if named != tag:
        named = named.hex() if isinstance(named, bytes) else repr(named)[:40]
        damage.append({"where": where, "what": f"its record names tag {named}, not {tag.hex()}"})
    capacity = entry.get("capacity_bytes")
    if capacity is None or (type(capacity) is int and capacity >= 0):
        space["capacity_bytes"] = capacity
    else:
        damage.append({"where": where, "what": f"its budget {str(capacity)[:40]!r} is not a byte count"})
    return tag, space


def summarize(path: str) -> dict[str, Any]:
    """Per-namespace summary of the disk tier at `path`: identity, budget, blocks, bytes,
    least and most recent LRU ticks; the data files; and `damage`, one `{"where", "what"}`
    for each namespace record or index entry that does not parse, each block whose slot lies
    past the end of its data file, and a `data.mdb` shorter than its meta page says (then
    nothing else is read). The pass goes on past each; payloads are not read. Raises
    `ConfigError` (a `ValueError`) naming the problem if `path` holds no kvstrata disk tier."""
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        raise ConfigError(f"{path!r} holds no kvstrata disk tier (no data.mdb)")
    files = SlotFiles(path).file_sizes()
    report: dict[str, Any] = {"path": os.path.abspath(path), "map_bytes": 0,
                              "index_bytes": os.path.getsize(os.path.join(path, "data.mdb")),
                              "data_files": {str(size): n for size, n in sorted(files.items())}}
    damage: list[dict[str, str]] = []
    spaces: dict[bytes, dict[str, Any]] = {}
    try:
        with _read_only_index(path) as (env, dbs):
            index_db, _, _, _, meta = dbs
            try:
                with env.begin(buffers=True) as txn:
                    for key, value in txn.cursor(db=meta):
                        if bytes(key).startswith(b"ns:"):
                            tag, space = _namespace_record(bytes(key), bytes(value), damage)
                            spaces[tag] = space
                    for key, raw in txn.cursor(db=index_db):
                        _count_entry(bytes(key), raw, spaces, files, damage)
            except lmdb.Error as exc:  # a damaged page: what was read so far stands
                damage.append({"where": "data.mdb", "what": f"LMDB stopped reading: {exc}"[:300]})
            report["map_bytes"] = env.info()["map_size"]
    except TruncatedIndexError as exc:  # nothing in the index may be touched: that is the damage
        damage.append({"where": "data.mdb", "what": str(exc)})
    return {**report, "namespaces": {s.pop("namespace"): s for s in spaces.values()}, "damage": damage}


def _count_entry(key: bytes, raw: Any, spaces: dict[bytes, dict[str, Any]], files: dict[int, int],
                 damage: list[dict[str, str]]) -> None:
    """Count one index entry into its namespace's summary, or note what is wrong with it."""
    tag = key[:TAG_BYTES]
    space = spaces.get(tag)
    if space is None:
        space = spaces[tag] = _space(f"(unregistered tag {tag.hex()})")
    where = f"block {key.hex()} of namespace {space['namespace']}"
    try:
        e = unpack_entry(raw)
    except CorruptRecordError as exc:
        space["damaged_blocks"] += 1
        damage.append({"where": where, "what": f"its index entry is damaged ({exc})"})
        return
    end, size = e.slot * e.slot_bytes + e.length, files.get(e.slot_bytes)
    if size is None or size < end:
        space["damaged_blocks"] += 1
        problem = "is missing" if size is None else f"holds {size} bytes"
        damage.append({"where": where, "what": f"its payload ends at byte {end} of {file_name(e.slot_bytes)}, "
                                               f"which {problem}: the file was truncated or removed"})
        return
    space["blocks"] += 1
    space["bytes"] += block_cost(e.slot_bytes)
    old, new = space["oldest_tick"], space["newest_tick"]
    space["oldest_tick"] = e.tick if old is None else min(old, e.tick)
    space["newest_tick"] = e.tick if new is None else max(new, e.tick)
