"""Progress bars for commands that run longer than a few seconds.

tqdm when the `bench` extra is installed; otherwise Click's bar (Click is a core dependency:
the command line is built on it). Either way on stderr, and hidden when stderr is not a
terminal, so piped output and tests stay clean.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import click


class _ClickBar:
    """The part of tqdm's interface the commands use, over `click.progressbar`."""

    def __init__(self, iterable: Iterable[Any] | None, desc: str | None = None, total: int | None = None,
                 disable: bool | None = False, **_: Any) -> None:
        self._iterable = iterable
        if total is None and isinstance(iterable, Sized):
            total = len(iterable)
        self._bar: Any = None
        if disable is not True and sys.stderr.isatty():
            self._bar = click.progressbar(iterable, length=total, label=desc or "", file=sys.stderr)

    def __iter__(self) -> Iterator[Any]:
        if self._bar is None:
            yield from (self._iterable if self._iterable is not None else ())
            return
        with self._bar as bar:
            yield from bar

    def __enter__(self) -> _ClickBar:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __getattr__(self, name: str) -> Any:  # set_postfix, set_description, close, ...: nothing to show
        return lambda *args, **kwargs: None


def tqdm(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """`tqdm.tqdm(iterable, **kwargs)` if tqdm is installed (`pip install 'kvstrata[bench]'`),
    else a Click progress bar with the same use: iterate it, or `with` it and `update(n)`."""
    try:
        from tqdm import tqdm as bar
    except ImportError:
        return _ClickBar(iterable, **kwargs)
    return bar(iterable, **kwargs)
