"""Progress bars for long benchmarks: tqdm when the `bench` extra is installed, else none."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def tqdm(iterable: Iterable[T], **kwargs: Any) -> Iterator[T]:
    """`tqdm.tqdm(iterable, **kwargs)` if tqdm is installed (`pip install 'kvstrata[bench]'`),
    else the iterable itself: a benchmark never fails for want of a progress bar."""
    try:
        from tqdm import tqdm as bar
    except ImportError:
        return iter(iterable)
    return iter(bar(iterable, **kwargs))
