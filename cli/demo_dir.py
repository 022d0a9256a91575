"""The folder a demo works in: one kvstrata made and marked, the only thing a demo deletes.

`prepare(parent, name, fresh=...)` gives the demo `<parent>/<name>`. kvstrata creates that
folder itself (and `parent` if missing) and writes a marker file, `.kvstrata-demo`, into it
first. A later run removes and recreates the folder only if it finds that marker (with
`fresh=False` it reuses it). A `<parent>/<name>` without the marker (a user's folder, a
file, a link) is refused with one line and left as it is, and nothing else under `parent`
is ever touched. Each demo has its own `name`, so demos never share or wipe each other's
data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvstore.errors import KVStoreError

MARKER = ".kvstrata-demo"


class DemoDirError(KVStoreError, ValueError):
    """The demo's folder exists and kvstrata did not make it."""


def is_ours(folder: Path) -> bool:
    """Whether `folder` is a real directory (not a link) holding kvstrata's marker file."""
    marker = folder / MARKER
    return (not folder.is_symlink() and folder.is_dir() and marker.is_file() and not marker.is_symlink())


def prepare(parent: str | Path, name: str, *, fresh: bool) -> Path:
    """`<parent>/<name>`, a folder made by kvstrata: emptied first if `fresh`, reused if not.

    Creates `parent` if missing (never removes it). Raises `DemoDirError` naming the path, and
    changes nothing, if `<parent>/<name>` exists but is not a marked kvstrata folder.
    """
    own = Path(parent) / name
    if own.is_symlink() or own.exists():
        if not is_ours(own):
            kind = "a link" if own.is_symlink() else "a file" if not own.is_dir() else "a folder kvstrata did not make"
            raise DemoDirError(f"{str(own)!r} is {kind} (it has no {MARKER} marker); kvstrata leaves it alone: "
                               f"move it away or pass another --disk-path")
        if not fresh:
            return own
        shutil.rmtree(own)
    own.mkdir(parents=True)
    (own / MARKER).write_text(json.dumps({"made_by": "kvstrata", "demo": name,
                                          "note": "kvstrata deletes this folder on the demo's next run"}) + "\n")
    return own
