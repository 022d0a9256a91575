"""The tests' switches: the family `KVSTRATA_TEST_*` (docs/configuration.md has the table).

Read once per process (`switches()`); an unknown `KVSTRATA_TEST_*` variable (a typo) or a bad
value fails the run with one error naming it and the known variables.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvstore.settings import TEST_PREFIX, EnvSettings, parse_bool, parse_float, parse_int, parse_str


@dataclass(frozen=True)
class Switches(EnvSettings):
    """Switches of the test suite (variables only).

    Attributes:
        require_redis: a missing `redis-server` fails the remote-tier tests instead of
            skipping them (CI).
        require_mooncake: a missing Mooncake (its store client and `mooncake_master`, the
            `mooncake` extra) fails the Mooncake tier's tests instead of skipping them (CI).
        require_vllm: a missing vLLM fails the connector's tests instead of skipping them (CI).
        require_dynamo: a missing Dynamo indexer (`.venv-dynamo`) fails its tests (CI).
        pool_device: the block pool's device in tests that have one ("cuda" on a GPU machine:
            pinned CPU slab, side-stream demotion).
        rel_scale: multiplies every count of the reliability suite (tests/reliability).
        rel_seed: the reliability suite's random seed.
        rel_report: where the reliability suite writes its figures (JSON).
    """

    PREFIX: ClassVar[str] = TEST_PREFIX
    FOREIGN: ClassVar[tuple[str, ...]] = ()

    require_redis: bool = False
    require_mooncake: bool = False
    require_vllm: bool = False
    require_dynamo: bool = False
    pool_device: str = "cpu"
    rel_scale: float = 1.0
    rel_seed: int = 7
    rel_report: str = "results/reliability.json"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("require_redis", "require_mooncake", "require_vllm", "require_dynamo"):
            set_(self, name, parse_bool(name, getattr(self, name)))
        parse_str("pool_device", self.pool_device, empty=False)
        parse_str("rel_report", self.rel_report, empty=False)
        set_(self, "rel_scale", parse_float("rel_scale", self.rel_scale, 0, 1e6, above_low=True))
        set_(self, "rel_seed", parse_int("rel_seed", self.rel_seed, 0, 2**32 - 1))


@functools.cache
def switches() -> Switches:
    """The switches of `os.environ`, parsed on first use."""
    return Switches.from_sources()


def need_vllm() -> None:
    """Import vLLM, or skip the calling test (or module, at import) with the reason; under
    `KVSTRATA_TEST_REQUIRE_VLLM` (CI) a missing vLLM is an error instead of a skip."""
    if switches().require_vllm:
        import vllm  # noqa: F401  (CI: a missing vllm is a failure, not a skip)
    else:
        pytest.importorskip("vllm")
