"""Progress bars for long benchmarks: tqdm when the `bench` extra is installed, else none."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class _NoBar:
    """Stands in for a tqdm bar: iterates, works as a context manager, ignores updates."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable if self._iterable is not None else ())

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # update, set_postfix, close, ...: nothing to show
        return lambda *args, **kwargs: None


def tqdm(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """`tqdm.tqdm(iterable, **kwargs)` if tqdm is installed (`pip install 'kvstrata[bench]'`),
    else a silent stand-in: a benchmark never fails for want of a progress bar."""
    try:
        from tqdm import tqdm as bar
    except ImportError:
        return _NoBar(iterable)
    return bar(iterable, **kwargs)
