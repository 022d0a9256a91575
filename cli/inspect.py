"""`kvstrata inspect PATH`: what a disk tier holds, per namespace, read-only, and its damage.

Asks the disk tier (`tiers.disk.tier.summarize`) to read its index under PATH read-only (safe
while engines use it: readers take no writer lock) and prints, per namespace: the model
identity its stores registered (namespace text, layout, block size, hash algorithm), blocks,
bytes, damaged blocks, the LRU ticks of its least and most recently used blocks (a tick is
one recency update, not wall time), and the budget its last opener gave the tier; then the
index and data files. `--json` prints the same as JSON.

It exists to look at damaged tiers too: each damaged namespace record or index entry, block
whose payload lies past the end of its data file, or a truncated data.mdb is one line,
`damage: WHERE: WHAT` (under "damage" with `--json`), and the pass goes on past it. Payloads
are not read (the store checks each when it reads it).

Exit code: 0 nothing damaged; 1 damage reported; 2 a missing path, or one that holds no
kvstrata disk tier (one line on stderr).
"""

from __future__ import annotations

import json
from typing import Any

import click

from cli.args import CONTEXT, invoke
from cli.output import print_table
from tiers.disk.tier import summarize


def inspect(path: str) -> dict[str, Any]:
    """Per-namespace summary of the disk tier at `path`, with a list of what is damaged.
    Raises `ValueError` naming the problem if there is none there."""
    return summarize(path)


def _printable(value: object, limit: int = 60) -> str:
    text = str(value)
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _identity_text(identity: object) -> str:
    if isinstance(identity, list) and identity:
        name, *layout = identity
        return f"{_printable(name)} {_printable(layout, 80)}"
    return "-" if identity is None else _printable(identity)


@click.command("inspect", help=__doc__, context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def command(path: str, as_json: bool) -> int:
    try:
        report = inspect(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc) or type(exc).__name__, param_hint="PATH") from None
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return 1 if report["damage"] else 0
    rows = [[ns[:16], _identity_text(s["identity"]), s["blocks"], f"{s['bytes'] / 2**20:.1f}", s["damaged_blocks"],
             s["oldest_tick"] if s["oldest_tick"] is not None else "-",
             s["newest_tick"] if s["newest_tick"] is not None else "-",
             f"{s['capacity_bytes'] / 2**20:.0f}" if s["capacity_bytes"] else "-"]
            for ns, s in sorted(report["namespaces"].items(), key=lambda kv: -kv[1]["blocks"])]
    size, mapped = report["index_bytes"] / 2**20, report["map_bytes"] / 2**20
    data = sum(report["data_files"].values()) / 2**20
    print(f"{report['path']}: index data.mdb {size:.1f} MiB (map {mapped:.0f} MiB), slot files {data:.1f} MiB")
    print_table("disk tier by namespace",
                ["namespace", "model identity (name [layers, heads, dim, dtype, block, hash])", "blocks", "MiB",
                 "damaged", "oldest tick", "newest tick", "budget MiB"], rows)
    for d in report["damage"]:
        print(f"damage: {_printable(d['where'], 200)}: {_printable(d['what'], 400)}")
    return 1 if report["damage"] else 0


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata inspect")
