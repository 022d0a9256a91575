"""Steps the real-vLLM verify test runs inside the engine's process between rounds
(`vllm_scenarios.py`'s `after_round`): the worker's store lives there, so its CPU tier can be
written only from there. `inject` puts another prompt's KV under prompt A's block key in one
chosen tier each, through that tier's own `put` (its checksum and A's token ids written as
for any block: intact, but wrong); `check` says what each tier holds for those keys now,
with the store's verify counters, its `kvstrata_verify_mismatch_total` series and the
warnings verify mode logged.

The scenario spec names them: `"verify_inject": {"a": prompt index, "b": prompt index,
"blocks": {tier: block index}}`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvstore import KVCacheStore
from tiers.base import Tier
from tiers.keys import BlockKey

_RIGHT: dict[str, tuple[int, torch.Tensor]] = {}  # tier -> (block index, A's right KV there)
_WARNINGS: list[str] = []


class _Capture(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _WARNINGS.append(record.getMessage())


def _store() -> KVCacheStore:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    [worker] = get_kv_transfer_group().worker.workers  # one KV cache group
    return worker.store


def _settle(store: KVCacheStore) -> None:
    """Wait (bounded) until the worker's queued saves are written and sent."""
    from engine_adapter.vllm.worker_side import PENDING

    deadline = time.monotonic() + 60
    while PENDING.any(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    store.flush()


def _keys(store: KVCacheStore, spec: dict[str, Any], index: int) -> list[BlockKey]:
    prompt = spec["prompts"][index]
    return list(store.keys(prompt["ids"] if isinstance(prompt, dict) else prompt))


def _read(store: KVCacheStore, tier: Tier, key: BlockKey) -> torch.Tensor | None:
    out = torch.empty(store.config.block_shape, dtype=store.config.layout.dtype)
    return out if tier.get_into([key], [out]) == 1 else None


def inject(llm: object, spec: dict[str, Any]) -> dict[str, Any]:
    """Put prompt B's block i under prompt A's block i in the tier each `blocks` entry names."""
    store = _store()
    _settle(store)
    plan = spec["verify_inject"]
    keys_a, keys_b = _keys(store, spec, plan["a"]), _keys(store, spec, plan["b"])
    tiers = {t.kind.value: t for t in store.tiers}
    held = {kind: t.match_prefix([k.block_hash for k in keys_a]) for kind, t in tiers.items()}
    report: dict[str, Any] = {"held": held, "num_blocks": len(keys_a), "injected": {}}
    with store._lock:  # the engine is idle between rounds; the store's own lock all the same
        for kind, i in plan["blocks"].items():
            tier = tiers[kind]
            right, other = _read(store, tier, keys_a[i]), _read(store, tier, keys_b[i])
            assert right is not None and other is not None, f"{kind} holds no block {i} of A or B"
            assert not torch.equal(right, other)
            _RIGHT[kind] = (i, right)
            tier.discard([keys_a[i].block_hash])
            tier.put([keys_a[i]], [other])
    store.flush()
    for kind, i in plan["blocks"].items():  # each tier now serves B's KV, intact, under A's key
        got = _read(store, tiers[kind], keys_a[i])
        other = _read(store, tiers[kind], keys_b[i])
        report["injected"][kind] = got is not None and other is not None and torch.equal(got, other)
    logging.getLogger("kvstore.verify").addHandler(_Capture(logging.WARNING))
    return report


def check(llm: object, spec: dict[str, Any]) -> dict[str, Any]:
    """What each tier holds under A's injected keys ("right", "wrong" or "missing"), the store's
    verify counters and metric series, and the warnings logged since `inject`."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvstore.metrics import register_metrics

    store = _store()
    _settle(store)
    keys_a = _keys(store, spec, spec["verify_inject"]["a"])
    tiers = {t.kind.value: t for t in store.tiers}
    holds: dict[str, str] = {}
    for kind, (i, right) in _RIGHT.items():
        got = _read(store, tiers[kind], keys_a[i])
        holds[kind] = "missing" if got is None else "right" if torch.equal(got, right) else "wrong"
    stats = store.stats()
    registry = CollectorRegistry()
    register_metrics(store, registry)
    series = [line for line in generate_latest(registry).decode().splitlines()
              if line.startswith("kvstrata_verify_mismatch_total")]
    return {"holds": holds, "warnings": list(_WARNINGS), "metric": series,
            "mismatches": {k.value: n for k, n in stats.verify_mismatches.items()},
            "max_error": {k.value: e for k, e in stats.verify_max_error.items()},
            "bound": {k.value: b for k, b in stats.verify_bound.items()},
            "namespace": store.config.namespace}


def bounds(llm: object, spec: dict[str, Any]) -> dict[str, Any]:
    """The store's verify counters: per tier, mismatches, the largest error seen, the bound."""
    store = _store()
    _settle(store)
    stats = store.stats()
    return {"mismatches": {k.value: n for k, n in stats.verify_mismatches.items()},
            "max_error": {k.value: e for k, e in stats.verify_max_error.items()},
            "bound": {k.value: b for k, b in stats.verify_bound.items()}}
