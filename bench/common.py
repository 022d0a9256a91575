"""Shared benchmark plumbing: timing, tables, JSON results, machine description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.settings import results_dir

RESULTS_DIR = Path(results_dir())  # KVSTRATA_BENCH_RESULTS


def timeit(fn: Callable[[], object], *, repeat: int = 5, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn` over `repeat` runs (seconds); `setup` runs untimed before each."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> dict[str, object]:
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
    """Write `payload` plus the machine description to results/<name>.json; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2, default=str))
    print(f"\nresults written to {path}")
    return path


def drop_file_cache(path: str | Path) -> bool:
    """Ask the kernel to drop `path`'s clean pages from the page cache; True if it could."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def pyplot() -> Any | None:
    """matplotlib's pyplot (Agg backend), or None with a one-line hint when the optional
    `bench` extra is not installed: a benchmark then still prints and saves its figures."""
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install 'kvstrata[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, ax: Any, path: Path, title: str) -> None:
    """Title, grid and legend on `ax`, then write `fig` to `path` as PNG and close it.

    `fig`/`ax` are matplotlib's Figure and Axes (typed Any: matplotlib is an optional import).
    """
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
