"""What the `kvstrata` commands print and save: aligned tables, JSON results with the machine
description (under `KVSTRATA_BENCH_RESULTS`, default results/)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cli.settings import results_dir

RESULTS_DIR = Path(results_dir())  # KVSTRATA_BENCH_RESULTS


def machine() -> dict[str, object]:
    """The platform, Python, torch, CPU count and CUDA device a result was measured on."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print an aligned plain-text table."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def write_results(name: str, payload: dict[str, object]) -> Path:
    """Write `payload` plus the machine description to <RESULTS_DIR>/<name>.json; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2, default=str))
    print(f"\nresults written to {path}")
    return path


def write_report(report: dict[str, Any], name: str, out: str | None = None) -> Path:
    """Write a script's `report` as JSON to `out` (default results/<name>_<UTC time>.json,
    its folder made); print and return the path."""
    path = Path(out or f"results/{name}_{time.strftime('%Y%m%d_%H%M%S', time.gmtime())}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"results written to {path}")
    return path
