"""Argument parsing for every `kvstrata` command: validated types and one-line errors.

A user mistake (a negative size, a file where a directory belongs, a missing trace) ends the
command with one line naming the bad value, `kvstrata <command>: error: ...`, and exit
code 2, before anything runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (no upper bound when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{value} is not {bound}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_in(1)
nonneg_int = int_in(0)


def int_list(low: int, high: int | None = None) -> Callable[[str], list[int]]:
    """An argparse type: a non-empty comma list of ints, each in [low, high]."""
    one = int_in(low, high)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} lists no value")
        return [one(x) for x in items]

    parse.__name__ = "list"
    return parse


def directory(text: str) -> str:
    """An argparse type: a path that is a directory or can become one (not a file)."""
    if not text or "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a usable path")
    probe = text
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip(os.sep))
    if probe and not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory ({probe!r} is a file)")
    return text


def existing_file(text: str) -> str:
    """An argparse type: a file that exists."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def check_results_dir() -> str | None:
    """Why `KVSTRATA_RESULTS` cannot hold results, or None if it can."""
    path = os.environ.get("KVSTRATA_RESULTS")
    if path is None:
        return None
    try:
        directory(path)
    except argparse.ArgumentTypeError as exc:
        return f"KVSTRATA_RESULTS: {exc}"
    return None
