"""Runs a real vLLM engine scenario (`tests/engine_adapter/vllm/vllm_scenarios.py`) in a fresh process for the
tests of hybrid, tensor-parallel and pipeline-parallel models, and cleans up after it."""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
_SHM = "/dev/shm/vllm_dist_*"  # what vLLM's CPU tensor/pipeline parallelism leaves behind
_RUNS = itertools.count()


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids of the tiny models' vocabulary, different for each seed."""
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(num_tokens)]


def connector(path: Path, **overrides: object) -> dict[str, object]:
    """The connector's settings over `path`: the defaults users get, with a disk and counters,
    and every hit loaded (these tiny models recompute a prompt faster than some loads take, so
    the default load policy may rightly recompute: its own tests cover that)."""
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = {"disk_path": str(path / "kv"), "disk_bytes": "256MiB", "cpu_bytes": "64MiB",
                                 "stats_path": str(path / "stats"), "load_policy": "always"}
    config.update(overrides)
    return config


def run_engine(spec: dict[str, object], *, multiprocess: bool = False, env: dict[str, str] | None = None,
               timeout: int = 420) -> dict:
    """Run one scenario in a fresh process; its result, or an AssertionError with its stderr.
    Its counters are its own (a fresh `stats_path` under the one given). Shared-memory files
    the engine's parallel workers left are removed (only those it made)."""
    if isinstance(spec.get("connector"), dict) and "stats_path" in spec["connector"]:  # type: ignore[operator]
        settings = dict(spec["connector"])  # type: ignore[call-overload]
        settings["stats_path"] = os.path.join(str(settings["stats_path"]), f"run-{next(_RUNS)}")
        spec = {**spec, "connector": settings}
    before = set(glob.glob(_SHM))
    full_env = dict(os.environ)
    full_env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                     "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    try:
        proc = subprocess.run([sys.executable, str(SCENARIOS), json.dumps(spec)], env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        for path in set(glob.glob(_SHM)) - before:
            with contextlib.suppress(OSError):
                os.remove(path)
    if proc.returncode != 0:
        raise AssertionError(f"scenario failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stat(result: dict, key: str, role: str = "") -> int:
    """A connector counter summed over the processes (of `role`, e.g. "worker", if given)."""
    return sum(s.get(key, 0) for name, s in result["stats"].items() if name.startswith(role))


def per_worker(result: dict, key: str) -> list[int]:
    """A counter of each worker process, in pid order."""
    names = sorted((n for n in result["stats"] if n.startswith("worker-")), key=lambda n: int(n.split("-")[1]))
    return [result["stats"][n].get(key, 0) for n in names]


def reply(result: dict, round_index: int, position: int = 0) -> tuple[int, list[int]]:
    """(cached prompt tokens, generated tokens) of one request of one round."""
    r = result["rounds"][round_index][position]
    return r["num_cached_tokens"], r["output"]


def disk_blocks(settings: dict[str, object]) -> list[int]:
    """The blocks each namespace holds on the connector's disk (`kvstrata inspect`), sorted."""
    from cli.inspect import inspect

    return sorted(space["blocks"] for space in inspect(str(settings["disk_path"]))["namespaces"].values())
