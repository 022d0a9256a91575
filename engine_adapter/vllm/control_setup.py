"""The connector's control listener (`control_endpoint`): where it runs and on which store.

The listener (`engine_adapter/control.py`) prefetches into the store whose CPU tier the
worker loads from, so it runs beside the worker's store: in the worker process (vLLM's
multiprocess mode) or the one process (single-process mode). Its keys are the connector's
for a request of those token ids and that cache salt, so it needs what makes a request's
keys those of one store: one worker (no tensor or pipeline parallelism, whose shards each
hold a part) and one KV cache group; anything else is refused at start-up (`ConfigError`).
"""

from __future__ import annotations

from collections.abc import Callable

from engine_adapter.control import ControlListener, parse_endpoint
from engine_adapter.vllm.settings import ConnectorSettings
from kvstore import KVCacheStore
from kvstore.bearer import read_token
from kvstore.errors import ConfigError


def open_control(settings: ConnectorSettings, stores: list[KVCacheStore], num_places: int,
                 count: Callable[[str, int], None]) -> ControlListener | None:
    """The started listener of `control_endpoint` over the worker's one store (None without
    the setting); `ConfigError` where it cannot key requests as the connector does, or cannot
    bind. `count` is told each request's outcome (`control_<outcome>` counters)."""
    if settings.control_endpoint is None:
        return None
    if num_places != 1 or len(stores) != 1:
        raise ConfigError(f"control_endpoint needs one worker and one KV cache group (here {num_places} worker(s), "
                          f"{len(stores)} store(s)): prefetch cannot key their shards from a prompt")
    store = stores[0]
    if not any(t.traits.memory and not t.traits.engine_memory for t in store.tiers) or all(
            t.traits.memory for t in store.tiers):
        raise ConfigError("control_endpoint prefetches from a slow tier (disk, remote) into the CPU tier: this store "
                          f"has not both ({[t.kind.value for t in store.tiers]})")
    host, port = parse_endpoint("control_endpoint", settings.control_endpoint)
    token = None if settings.control_token_file is None else read_token("control_token_file",
                                                                       settings.control_token_file)
    listener = ControlListener(store, host, port, token=token)
    listener.on_count = count
    return listener.start()
