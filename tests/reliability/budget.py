"""The reliability suite's counts, scaled by its knobs (`KVSTRATA_TEST_REL_*`, in `tests/switches.py`).

The defaults keep the whole suite near two minutes on two cores, which is what CI runs. A longer
manual run scales every count at once, e.g. `KVSTRATA_TEST_REL_SCALE=10 pytest tests/reliability`;
`docs/reliability.md` gives the figures of such a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.switches import switches


@dataclass(frozen=True)
class Budget:
    """Counts of the reliability suite, each the CI default times `scale`.

    Attributes:
        scale: KVSTRATA_TEST_REL_SCALE, multiplies every count below (default 1).
        seed: KVSTRATA_TEST_REL_SEED, the root of every random choice (default 7).
    """

    scale: float
    seed: int

    def count(self, base: int) -> int:
        return max(1, round(base * self.scale))

    @property
    def num_kills(self) -> int:
        """SIGKILLs per crash-test mode (two modes)."""
        return self.count(20)

    @property
    def num_corruptions(self) -> int:
        """Records damaged per corruption test."""
        return self.count(40)

    @property
    def hypothesis_examples(self) -> int:
        """`max_examples` of each property-based test."""
        return self.count(60)

    @property
    def num_threads(self) -> int:
        return 8

    @property
    def ops_per_thread(self) -> int:
        return self.count(250)

    @property
    def num_processes(self) -> int:
        return 4

    @property
    def process_seconds(self) -> float:
        """How long each process of the shared-directory test runs."""
        return 3.0 * self.scale

    @property
    def leak_iterations(self) -> int:
        return self.count(1500)

    @property
    def reopen_cycles(self) -> int:
        return self.count(60)


def load_budget() -> Budget:
    settings = switches()
    return Budget(scale=settings.rel_scale, seed=int(settings.rel_seed or 0))


BUDGET = load_budget()
