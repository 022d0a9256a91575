"""Runs one vLLM scenario in a fresh process and prints its result as JSON (last line).

Used by `tests/engine_adapter/vllm/test_vllm_connector.py`: every scenario gets its own process, as a real
deployment would, so vLLM's process-global state never leaks between tests. Usage:
`python tests/engine_adapter/vllm/vllm_scenarios.py '<json spec>'`, spec keys: model, prompts (token-id lists, or
`{"ids": [...], "cache_salt": "...", "kv_transfer_params": {...}}`),
rounds (an int: every prompt that many times; or lists of prompt indices, one per round),
loras (name -> adapter directory; a prompt dict's "lora" names one),
reset_between, max_tokens, connector (extra config dict or null), num_blocks, max_model_len,
llm (more `LLM(...)` arguments, overriding the defaults: e.g. dtype, block_size (null: vLLM's
choice), tensor_parallel_size, pipeline_parallel_size, enforce_eager), connector_name and
module_path (how vLLM finds the connector: default "TierKVConnector" in
"engine_adapter.vllm.connector"; a null module_path uses the name kvstrata's plugin registers),
connector_role (vLLM's kv_role, default "kv_both"), asleep_rounds (round indices run with the
worker's connector told vLLM's KV memory is gone: `unregister_kv_caches` before the round,
`restore_kv_caches` after; one process only), prefetch (`{"before_round": R, "url": URL,
"bodies": [...]}`: each body POSTed to the connector's control listener before round R; a
body's "prompt": i stands for prompt i's token ids (and cache salt); the answers are in the
result's "prefetches" as [status, body]), after_round (round index as text ->
"module:function", a module beside this script (not a package path: CI runs without the
checkout on sys.path), called in the engine's process as `function(llm, spec)` once that round
ended; what it returns, JSON, is the result's `after_round` entry of that index: tests reach
the connector's stores between rounds this way).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time


def _stats(stats_path: str | None) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    if stats_path:
        for path in sorted(glob.glob(os.path.join(stats_path, "*.json"))):
            with open(path) as f:
                out[os.path.basename(path)[: -len(".json")]] = json.load(f)
    return out


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec.get("connector_name", "TierKVConnector"),
            kv_connector_module_path=spec.get("module_path", "engine_adapter.vllm.connector"),
            kv_role=spec.get("connector_role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            kv_load_failure_policy="recompute",
        )
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    loras = spec.get("loras") or {}  # name -> adapter directory
    if loras:
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=len(loras))
    kwargs = {"enforce_eager": True, "block_size": 32, "dtype": "float32", **kwargs, **(spec.get("llm") or {})}
    if kwargs["block_size"] is None:
        del kwargs["block_size"]
    llm = LLM(model=spec["model"], max_model_len=spec.get("max_model_len", 4096), seed=0, **kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    schedule = spec.get("rounds", 1)
    if isinstance(schedule, int):
        schedule = [list(range(len(spec["prompts"])))] * schedule
    rounds = []
    hooks: dict[str, object] = {}
    asleep = set(spec.get("asleep_rounds") or ())
    prefetches: list = []
    for round_index, order in enumerate(schedule):
        if (spec.get("prefetch") or {}).get("before_round") == round_index:
            prefetches = _prefetch(spec["prefetch"], spec["prompts"])
        if round_index in asleep:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().unregister_kv_caches()
        requests = []
        for index in order:
            prompt = spec["prompts"][index]
            request = {"prompt_token_ids": prompt}
            if isinstance(prompt, dict):
                request = {"prompt_token_ids": prompt["ids"]}
                if prompt.get("cache_salt") is not None:
                    request["cache_salt"] = prompt["cache_salt"]
            lora = None
            if isinstance(prompt, dict) and prompt.get("lora"):
                from vllm.lora.request import LoRARequest

                names = sorted(loras)
                lora = LoRARequest(prompt["lora"], names.index(prompt["lora"]) + 1, loras[prompt["lora"]])
            step_params = params
            if isinstance(prompt, dict) and prompt.get("kv_transfer_params") is not None:
                step_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0,
                                             extra_args={"kv_transfer_params": prompt["kv_transfer_params"]})
            t0 = time.perf_counter()
            out = llm.generate([request], step_params, use_tqdm=False, lora_request=lora)[0]
            requests.append(
                {
                    "prompt": index,
                    "output": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens or 0,
                    "seconds": time.perf_counter() - t0,
                    "kv_transfer_params": out.kv_transfer_params,
                }
            )
        rounds.append(requests)
        hook = (spec.get("after_round") or {}).get(str(round_index))
        if hook:
            import importlib

            module, function = hook.split(":")
            hooks[str(round_index)] = getattr(importlib.import_module(module), function)(llm, spec)
        if round_index in asleep:
            get_kv_transfer_group().restore_kv_caches()
        if spec.get("reset_between"):
            llm.reset_prefix_cache()
    drafts = 0  # tokens speculative decoding proposed (vLLM's metric; with its stats on)
    if not kwargs.get("disable_log_stats", True):
        drafts = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics()
                     if m.name == "vllm:spec_decode_num_draft_tokens")
    stats_path = (spec.get("connector") or {}).get("stats_path")
    # Workers in other processes flush their stores and stats now; vLLM kills an engine process
    # still shutting down after 5 s (its default), which a loaded CI machine can take.
    llm.llm_engine.engine_core.shutdown(timeout=60)
    del llm
    return {"pid": os.getpid(), "rounds": rounds, "stats": _stats(stats_path), "draft_tokens": drafts,
            "prefetches": prefetches, "after_round": hooks}


def _prefetch(spec: dict, prompts: list) -> list:
    """POST each of `spec`'s bodies to the control listener; [[status, answer], ...]."""
    import urllib.error
    import urllib.request

    answers = []
    for body in spec["bodies"]:
        body = dict(body)
        if "prompt" in body:
            prompt = prompts[body.pop("prompt")]
            body["prompt_token_ids"] = prompt["ids"] if isinstance(prompt, dict) else prompt
            if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
                body["cache_salt"] = prompt["cache_salt"]
        req = urllib.request.Request(spec["url"], data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                answers.append([resp.status, json.loads(resp.read())])
        except urllib.error.HTTPError as exc:
            answers.append([exc.code, json.loads(exc.read())])
    return answers


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    print("\n" + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's slow interpreter teardown; the store is already flushed
