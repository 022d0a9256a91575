"""Child processes for the reliability suite.

Children come from a fork server that imported torch and kvstrata once, so each of the many
processes a test starts (and SIGKILLs) costs milliseconds, not a fresh interpreter's seconds;
each is still a fresh process that opens its own LMDB environment.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import time
from pathlib import Path
from typing import Any

_CTX: multiprocessing.context.ForkServerContext | None = None


def context() -> multiprocessing.context.ForkServerContext:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        workers = __name__.rsplit(".", 1)[0] + ".workers"
        _CTX.set_forkserver_preload(["torch", "kvstore", "tiers.disk.tier", workers])
    return _CTX


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as JSON atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def wait_for(path: str | Path, proc: multiprocessing.process.BaseProcess, timeout_s: float) -> bool:
    """Wait until `path` exists; False if `proc` died first. Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if not proc.is_alive():
            return os.path.exists(path)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.005)
    return True


def error_of(path: str | Path) -> str:
    """The traceback a worker left in `path`.err, or a note that it left none."""
    err = Path(f"{path}.err")
    return err.read_text() if err.exists() else "(the worker left no traceback)"
