"""The `kvstrata` command's settings (its benchmarks and demos): the family `KVSTRATA_BENCH_*`
(docs/configuration.md has the table).

An unknown `KVSTRATA_BENCH_*` variable (a typo) or a bad value is refused naming it; `kvstrata`
then refuses to run, with one line (`environment_problem`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvstore.errors import ConfigError
from kvstore.settings import BENCH_PREFIX, EnvSettings, parse_str


@dataclass(frozen=True)
class BenchSettings(EnvSettings):
    """Settings of the benchmarks (variables only).

    Attributes:
        results: where benchmarks write their JSON and plots.
        workdir: where `scripts/gpu_checks.sh offload` keeps its disk tier (a fast local disk).
    """

    PREFIX: ClassVar[str] = BENCH_PREFIX
    FOREIGN: ClassVar[tuple[str, ...]] = ()

    results: str = "results"
    workdir: str = "/tmp"

    def __post_init__(self) -> None:
        parse_str("results", self.results, empty=False)
        parse_str("workdir", self.workdir, empty=False)


def results_dir() -> str:
    """`KVSTRATA_BENCH_RESULTS` as parsed; the default when the environment is bad (the
    `kvstrata` command refuses to run then, with one line naming the problem)."""
    try:
        return BenchSettings.from_sources().results
    except ConfigError:
        return BenchSettings.results


def environment_problem(directory_problem: Callable[[str], str | None]) -> str | None:
    """What is wrong with the `KVSTRATA_*` variables `kvstrata` reads (the library's and the
    connector's, and the benchmarks' family): an unknown one, a bad value, or a results
    directory that `directory_problem(path)` (a str or None) finds unusable; else None."""
    from engine_adapter.vllm.settings import ConnectorSettings
    from kvstore.settings import LibrarySettings

    try:
        ConnectorSettings.from_sources()
        LibrarySettings.from_environ()
        settings = BenchSettings.from_sources()
    except ConfigError as exc:
        return str(exc)
    if BENCH_PREFIX + "RESULTS" not in os.environ:
        return None
    problem = directory_problem(settings.results)
    return None if problem is None else f"{BENCH_PREFIX}RESULTS: {problem}"
