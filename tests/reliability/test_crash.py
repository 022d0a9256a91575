"""Crash safety: SIGKILL a process storing into an LMDB-backed store, again and again.

After every kill a fresh process reopens the store and checks, against a journal the killed
process wrote around each `store()`, that every block returned is bit-exact with its prefix,
that committed prompts are whole, that every record on disk validates, and that the tier's
accounting is intact. The kill lands at a random moment: mostly while storing, sometimes
while the previous victim's successor is still opening and verifying.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from . import procs
from .budget import BUDGET
from .conftest import Figures
from .kvgen import BLOCK, LAYOUT
from .workers import CrashSpec, crash_round

MODES: dict[str, dict[str, Any]] = {
    # Disk tier alone, fsync per commit, room for everything: nothing committed may be lost.
    "disk-sync": {"durable": True, "num_prompts": 384, "store_kwargs": {"disk_sync": True}},
    # CPU tier writing through to a 1 MiB disk tier: eviction runs on nearly every commit.
    "write-through-evicting": {
        "durable": False, "num_prompts": 2048,
        "store_kwargs": {
            "cpu_bytes": 24 * LAYOUT.block_bytes(BLOCK), "write_through": True,
            "disk_bytes": 1 << 20, "disk_sync": False,
        },
    },
    # A 16-block pool (evict-time demotion) over 24 CPU slots over a 1 MiB disk: blocks reach
    # disk only by pool -> CPU -> disk demotion, so the newest ones die with the process.
    "pool-demotion-evicting": {
        "durable": False, "newest_whole": False, "num_prompts": 2048,
        "store_kwargs": {
            "pool_blocks": 16, "pool_device": "cpu", "pool_demotion": "on_evict",
            "cpu_bytes": 24 * LAYOUT.block_bytes(BLOCK), "disk_bytes": 1 << 20, "disk_sync": False,
        },
    },
    # Pool demoting at cache time into a CPU tier, the store writing through to a roomy disk
    # tier: every committed prompt must survive whole.
    "pool-write-through": {
        "durable": True, "num_prompts": 384,
        "store_kwargs": {
            "pool_blocks": 16, "pool_device": "cpu", "pool_demotion": "write_through",
            "cpu_bytes": 24 * LAYOUT.block_bytes(BLOCK), "write_through": True, "disk_sync": False,
        },
    },
}


def _run_round(spec: CrashSpec, rng: np.random.Generator) -> tuple[bool, dict[str, Any] | None]:
    """Start a round, SIGKILL it at a random moment; return (killed early, its report)."""
    proc = procs.context().Process(target=crash_round, args=(spec,))
    proc.start()
    early = rng.random() < 0.2
    if early:  # while it opens or verifies
        time.sleep(rng.uniform(0.0, 0.3))
    else:
        procs.wait_for(spec.report_path, proc, timeout_s=120)
        time.sleep(rng.uniform(0.01, 0.35))
    if not proc.is_alive():
        proc.join()
        pytest.fail(f"round {spec.round_index} died on its own ({proc.exitcode}):\n"
                    + procs.error_of(spec.report_path))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    report = procs.read_json(spec.report_path) if os.path.exists(spec.report_path) else None
    if report is not None:
        os.remove(spec.report_path)
    return early, report


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_sigkill_while_storing_then_reopen(tmp_path: Path, mode: str, figures: Figures) -> None:
    cfg = MODES[mode]
    rng = np.random.default_rng([BUDGET.seed, 10, len(mode)])
    base = dict(
        disk_path=str(tmp_path / "disk"), journal_path=str(tmp_path / "journal"),
        report_path=str(tmp_path / "report.json"), seed=BUDGET.seed,
        num_prompts=cfg["num_prompts"], durable=cfg["durable"], store_kwargs=cfg["store_kwargs"],
        newest_whole=cfg.get("newest_whole", True),
    )
    num_kills = num_early = 0
    totals: dict[str, float] = {}
    for r in range(BUDGET.num_kills):
        early, report = _run_round(CrashSpec(round_index=r, **base), rng)
        num_kills += 1
        num_early += early
        for key, value in (report or {}).items():
            totals[key] = totals.get(key, 0) + value
    # A last fresh process reopens and checks every prompt ever begun.
    final = CrashSpec(round_index=BUDGET.num_kills, verify_only=True, **base)
    proc = procs.context().Process(target=crash_round, args=(final,))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == 0, procs.error_of(final.report_path)
    report = procs.read_json(final.report_path)
    for key, value in report.items():
        totals[key] = totals.get(key, 0) + value
    begun = sum(1 for line in Path(base["journal_path"]).read_text().splitlines() if line[0] == "B")

    assert num_kills == BUDGET.num_kills
    assert begun > 0, "the workers never stored anything"
    assert totals["blocks_verified"] > 0  # after a reopen only the disk tier holds blocks
    if cfg["durable"] or cfg.get("newest_whole", True):
        assert report["committed_whole"] > 0
    figures.set("kills_survived", num_kills)
    figures.set("kills_while_reopening", num_early)
    figures.set("stores_begun", begun)
    for key in ("blocks_verified", "prompts_checked", "committed_whole", "records_scrubbed"):
        figures.set(key, int(totals.get(key, 0)))
    figures.set("mean_reopen_verify_s", round(totals["verify_s"] / max(1, num_kills), 3))
