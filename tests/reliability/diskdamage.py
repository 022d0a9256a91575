"""Damage a disk tier the way a failing device or a stray writer would: bytes of a payload in
its slot file, bytes of an index entry inside `data.mdb`, or well-formed index values with
wrong contents written through LMDB (the directory must not be open in this process)."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np

from tiers.disk.index import Entry, pack_entry, unpack_entry
from tiers.disk.payload import payload_sum
from tiers.disk.tier import PayloadLocation


def read_payload(loc: PayloadLocation) -> bytes:
    with open(loc.file, "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.length)


def damage_payload(loc: PayloadLocation, kind: str, rng: np.random.Generator) -> None:
    """`payload-bit`: one flipped bit; `zero-run`: a torn sector (16..512 zero bytes);
    `tail-zeroed`: the end of the payload never reached the device."""
    data = bytearray(read_payload(loc))
    n = len(data)
    if kind == "payload-bit":
        start = int(rng.integers(n))
        data[start] ^= 1 << int(rng.integers(8))
    else:
        if kind == "zero-run":
            start = int(rng.integers(n - 16))
            end = min(n, start + int(rng.integers(16, 513)))
        else:
            assert kind == "tail-zeroed", kind
            start, end = n - int(rng.integers(1, min(n, 2048))), n
        if data[start:end] == bytes(end - start):
            data[start] ^= 0xFF
        else:
            data[start:end] = bytes(end - start)
    fd = os.open(loc.file, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(data), loc.offset)
    finally:
        os.close(fd)


def read_entry(path: Path, key: bytes) -> Entry:
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    try:
        with env.begin(db=env.open_db(b"index", create=False)) as txn:
            raw = txn.get(key)
    finally:
        env.close()
    assert raw is not None, "no index entry under that key"
    return unpack_entry(raw)


def put_entries(path: Path, values: dict[bytes, bytes]) -> None:
    """Replace the index values of existing keys."""
    with lmdb.open(str(path), max_dbs=8) as env, env.begin(write=True, db=env.open_db(b"index")) as txn:
        for key, value in values.items():
            assert txn.get(key) is not None
            txn.put(key, value)


def entry_with_tokens(path: Path, loc: PayloadLocation, tokens: bytes) -> bytes:
    """A sound entry for `loc`'s block, checksum and all, but naming other token ids (what a
    hash collision between two prefixes would look like)."""
    e = read_entry(path, loc.index_key)
    e = e._replace(tokens=tokens)
    xxh = payload_sum(loc.index_key, e, [np.frombuffer(read_payload(loc), np.uint8)])
    return pack_entry(e._replace(xxh=xxh))


def damage_entry_in_file(path: Path, key: bytes, kind: str, rng: np.random.Generator) -> None:
    """Flip bytes of an entry where it lies in `data.mdb` (every copy: copy-on-write leaves
    stale ones in free pages). `entry-checksum`: its xxh3; `entry-slot`: the slot it names;
    `entry-tokens`: a token id."""
    raw = pack_entry(read_entry(path, key))
    data_path = path / "data.mdb"
    data = bytearray(data_path.read_bytes())
    places = []
    at = data.find(raw)
    while at >= 0:
        places.append(at)
        at = data.find(raw, at + 1)
    assert places, "entry not found in data.mdb"
    # Offsets inside the packed entry (header <BBHIQQQQQIQ: slot at 16, xxh3 at 32), then parent,
    # extras, tokens.
    e = unpack_entry(raw)
    extras = len(e.extras or b"")
    header = len(raw) - len(e.parent) - extras - len(e.tokens)
    if kind == "entry-checksum":
        pos = 32 + int(rng.integers(8))
    elif kind == "entry-slot":
        pos = 16
    else:
        assert kind == "entry-tokens" and e.tokens, kind
        pos = header + len(e.parent) + extras + int(rng.integers(len(e.tokens)))
    for at in places:
        data[at + pos] ^= 1 << int(rng.integers(8))
    data_path.write_bytes(data)
