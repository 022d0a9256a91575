"""Helpers of the real-vLLM tests in their own files: a fresh engine process per scenario
(`tests/engine_adapter/vllm/vllm_scenarios.py`), prompts, connector settings and counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
BLOCK = 32  # the block size the scenarios give vLLM


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids of the tiny model's vocabulary, different for each seed."""
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(num_tokens)]


def run_scenario(spec: dict, *, multiprocess: bool = False, timeout: int = 240) -> dict:
    """Run one scenario in a fresh engine process; its result, or an AssertionError with the
    process's stderr."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                "TOKENIZERS_PARALLELISM": "false"})
    proc = subprocess.run([sys.executable, str(SCENARIOS), json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"scenario failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def connector_config(tmp_path: Path, **overrides: object) -> dict:
    """The connector's extra config over `tmp_path`, with the defaults users get otherwise."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = {"disk_path": str(tmp_path / "kv"), "disk_bytes": "256MiB", "cpu_bytes": "64MiB",
                                 "stats_path": str(tmp_path / "stats")}
    config.update(overrides)
    return config


def stat_sum(stats: dict[str, dict[str, int]], key: str) -> int:
    """A counter summed over the connector's roles (`stats_path` files)."""
    return sum(s.get(key, 0) for s in stats.values())
