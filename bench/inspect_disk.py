"""`kvstrata inspect PATH`: what a disk tier holds, per namespace, read-only.

Opens the LMDB environment under PATH read-only (safe while engines use it: readers take no
writer lock) and prints, per namespace: the model identity its stores registered (namespace
text, layout, block size, hash algorithm), blocks, bytes, the LRU ticks of its least and most
recently used blocks (a tick is one recency update, not wall time), and the budget its last
opener gave the tier. `--json` prints the same as JSON. A missing path, or one that holds no
kvstrata disk tier: one line on stderr, exit code 2.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import click
import lmdb
import msgpack

from bench.args import CONTEXT, invoke
from bench.common import print_table
from tiers.lmdb_record import record_bytes_on_disk

_TICK = struct.Struct(">Q")


def inspect(path: str) -> dict[str, Any]:
    """Per-namespace summary of the disk tier at `path`. Raises `ValueError` naming the
    problem if there is none there."""
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        raise ValueError(f"{path!r} holds no kvstrata disk tier (no data.mdb)")
    try:
        env = lmdb.open(path, readonly=True, lock=True, max_dbs=4, create=False)
    except lmdb.Error as exc:
        raise ValueError(f"{path!r} is not a readable LMDB environment: {exc}") from None
    try:
        try:
            blocks, atime, meta = (env.open_db(n, create=False) for n in (b"blocks", b"atime", b"meta"))
        except lmdb.Error:
            raise ValueError(f"{path!r} is an LMDB environment but not a kvstrata disk tier") from None
        spaces: dict[str, dict[str, Any]] = {}
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=meta):
                if bytes(key).startswith(b"ns:"):
                    entry = msgpack.unpackb(bytes(value), raw=False)
                    spaces[bytes(key)[3:].hex()] = {"identity": entry.get("identity"),
                                                    "capacity_bytes": entry.get("capacity_bytes"),
                                                    "blocks": 0, "bytes": 0, "oldest_tick": None,
                                                    "newest_tick": None}
            for h, value in txn.cursor(db=blocks):
                mv = memoryview(value)
                try:
                    hlen = struct.unpack("<I", mv[4:8])[0]
                    hdr = msgpack.unpackb(mv[8 : 8 + hlen], raw=False)
                    ns = bytes(hdr.get("ns", b"")).hex() or "(unlabelled: written before namespace tags)"
                except Exception:
                    ns = "(unreadable)"
                space = spaces.setdefault(ns, {"identity": None, "capacity_bytes": None, "blocks": 0, "bytes": 0,
                                               "oldest_tick": None, "newest_tick": None})
                space["blocks"] += 1
                space["bytes"] += record_bytes_on_disk(len(mv))
                tick = txn.get(bytes(h), db=atime)
                if tick is not None:
                    t = _TICK.unpack(bytes(tick))[0]
                    space["oldest_tick"] = t if space["oldest_tick"] is None else min(space["oldest_tick"], t)
                    space["newest_tick"] = t if space["newest_tick"] is None else max(space["newest_tick"], t)
        info = env.info()
    finally:
        env.close()
    return {"path": os.path.abspath(path), "map_bytes": info["map_size"],
            "file_bytes": os.path.getsize(os.path.join(path, "data.mdb")), "namespaces": spaces}


def _identity_text(identity: object) -> str:
    if isinstance(identity, list) and identity:
        name, *layout = identity
        text = str(name)
        if len(text) > 60:
            text = text[:57] + "..."
        return f"{text} {layout}"
    return "-"


@click.command("inspect", help=__doc__, context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def command(path: str, as_json: bool) -> int:
    try:
        report = inspect(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="PATH") from None
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    rows = [[ns[:16], _identity_text(s["identity"]), s["blocks"], f"{s['bytes'] / 2**20:.1f}",
             s["oldest_tick"] if s["oldest_tick"] is not None else "-",
             s["newest_tick"] if s["newest_tick"] is not None else "-",
             f"{s['capacity_bytes'] / 2**20:.0f}" if s["capacity_bytes"] else "-"]
            for ns, s in sorted(report["namespaces"].items(), key=lambda kv: -kv[1]["blocks"])]
    size, mapped = report["file_bytes"] / 2**20, report["map_bytes"] / 2**20
    print(f"{report['path']}: data.mdb {size:.1f} MiB, map {mapped:.0f} MiB")
    print_table("disk tier by namespace",
                ["namespace", "model identity (name [layers, heads, dim, dtype, block, hash])", "blocks", "MiB",
                 "oldest tick", "newest tick", "budget MiB"], rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata inspect")
