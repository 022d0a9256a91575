"""Shared benchmark plumbing: timing, the page cache, plots. Tables and JSON results are
`cli.output`'s (the demos print them too)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def child_env() -> dict[str, str]:
    """This process's environment, with this checkout first on `PYTHONPATH`: a child process
    started with `python -m bench...` or `-m cli.main` imports the same kvstrata."""
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def time_store_retrieve(store: Any, tokens: Any, kv: Any, out: Any, what: str = "") -> tuple[float, float]:
    """Seconds to `store` `kv` for `tokens` and flush it, and the better of two `retrieve`s into
    `out`; asserts the whole prompt came back bit-exact, then clears the store."""
    import torch

    t0 = time.perf_counter()
    store.store(tokens, kv)
    assert store.flush()
    t_store = time.perf_counter() - t0
    t_get = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        res = store.retrieve(tokens, out=out)
        t_get = min(t_get, time.perf_counter() - t0)
    assert res.num_tokens == len(tokens), f"{what}retrieved {res.num_tokens} of {len(tokens)} tokens"
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    store.clear()
    return t_store, t_get
