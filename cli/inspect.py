"""`kvstrata inspect PATH`: what a disk tier holds, per namespace, read-only.

Asks the disk tier (`tiers.lmdb.summarize`) to read its index under PATH read-only (safe
while engines use it: readers take no writer lock) and prints, per namespace: the model
identity its stores registered (namespace text, layout, block size, hash algorithm), blocks,
bytes, the LRU ticks of its least and most recently used blocks (a tick is one recency
update, not wall time), and the budget its last opener gave the tier; then the index and
data files. `--json` prints the same as JSON. A missing path, or one that holds no kvstrata
disk tier: one line on stderr, exit code 2.
"""

from __future__ import annotations

import json
from typing import Any

import click

from cli.args import CONTEXT, invoke
from cli.output import print_table
from tiers.lmdb import summarize


def inspect(path: str) -> dict[str, Any]:
    """Per-namespace summary of the disk tier at `path`. Raises `ValueError` naming the
    problem if there is none there."""
    return summarize(path)


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
    size, mapped = report["index_bytes"] / 2**20, report["map_bytes"] / 2**20
    data = sum(report["data_files"].values()) / 2**20
    print(f"{report['path']}: index data.mdb {size:.1f} MiB (map {mapped:.0f} MiB), slot files {data:.1f} MiB")
    print_table("disk tier by namespace",
                ["namespace", "model identity (name [layers, heads, dim, dtype, block, hash])", "blocks", "MiB",
                 "oldest tick", "newest tick", "budget MiB"], rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata inspect")
