"""`after_round` hooks for `vllm_scenarios.py` (run in the engine's process between rounds)."""

from __future__ import annotations

import shutil
from typing import Any


def retrain_in_place(llm: Any, spec: dict[str, Any]) -> str:
    """Rewrite the adapter named "mine" in its directory (another adapter, same name, path and
    int id) while the engine still holds the one it loaded."""
    from bench.tiny_model import build_tiny_lora

    path = spec["loras"]["mine"]
    shutil.rmtree(path)
    build_tiny_lora(path, seed=2)
    return "retrained"
