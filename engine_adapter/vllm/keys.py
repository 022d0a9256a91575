"""What besides token ids changes a vLLM request's KV, as kvstrata `ExtraKeys`.

Mirrors vLLM's own block hashing (`vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`):
the cache salt enters the first block, the LoRA adapter every block (by its files' content,
where vLLM uses its name and path: kvstrata's tiers outlive the process and span hosts), and
each multimodal input's identifier every block its placeholder span overlaps. A request
carrying anything else that vLLM mixes into its keys (prompt embeddings, or a kind of extra
key this module does not know), or an adapter whose files cannot be read, cannot be keyed
safely: it is neither looked up nor saved. Duck-typed over the request object, so it is tested without vLLM too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from engine_adapter.vllm.weights_identity import adapter_identity
from kvstore import ExtraKeys, MultiModalInput

# Kinds of vLLM extra keys this module turns into ExtraKeys.
KNOWN_VLLM_KEY_KINDS = frozenset({"lora", "mm", "cache_salt"})


class RequestKeys(NamedTuple):
    """The ExtraKeys of a request, or why it cannot be keyed (`extra_keys` is then None)."""

    extra_keys: ExtraKeys | None
    refusal: str | None = None

    @property
    def cacheable(self) -> bool:
        return self.refusal is None


class AdapterKeys:
    """One engine's LoRA adapters by vLLM int id, each keyed by the content its files had
    when this scheduler first saw it (`identify`): what the engine loaded. vLLM reloads an
    adapter only for a new int id or `load_inplace` (or after evicting it), so once the files
    differ from what was pinned (an adapter retrained in place under a running engine), the
    engine may compute with either version: that id is refused until a `load_inplace`
    request pins the new content. Names, paths and ids are not in the key: two engines
    loading the same bytes share keys."""

    def __init__(self, identify: Callable[[str], str | None] = adapter_identity) -> None:
        self._identify = identify
        self._pinned: dict[object, str] = {}  # int id -> content digest
        self._diverged: set[object] = set()  # int ids whose files changed under the engine

    def key(self, lora_request: Any) -> tuple[str | None, str]:
        """(The adapter's key, or None), and why not."""
        path = getattr(lora_request, "lora_path", None)
        content = self._identify(path) if isinstance(path, str) and path else None
        if content is None:
            return None, "its files cannot be read to identify it (a local directory with adapter_config.json)"
        lora_id = getattr(lora_request, "lora_int_id", None)
        if lora_id not in self._pinned or getattr(lora_request, "load_inplace", False):
            self._pinned[lora_id] = content  # (vLLM loads it now)
            self._diverged.discard(lora_id)
        elif content != self._pinned[lora_id]:
            self._diverged.add(lora_id)
        if lora_id in self._diverged:
            return None, (f"its files changed after this engine loaded it as int id {lora_id}: not keyed until "
                          "a request loads it again with load_inplace")
        return json.dumps(["lora", self._pinned[lora_id], bool(getattr(lora_request, "is_3d_lora_weight", False))]), ""


def request_keys(
    request: Any,
    block_size: int,
    vllm_extra_keys: Callable[[Any, int, int, int], tuple[tuple[Any, ...] | None, int]] | None = None,
    adapters: AdapterKeys | None = None,
) -> RequestKeys:
    """The `ExtraKeys` that make `request`'s blocks unique, or a refusal.

    `vllm_extra_keys` is vLLM's `generate_block_hash_extra_keys`; when given, every block's
    extra keys as vLLM computes them are checked to be of kinds this module maps, so a
    feature added to vLLM's keys later is refused rather than silently ignored. `adapters`
    keys a LoRA adapter (the engine's scheduler keeps one; a fresh one otherwise).
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestKeys(None, "prompt_embeds requests are keyed by their embeddings, not token ids")
    salt = getattr(request, "cache_salt", None) or None
    lora = getattr(request, "lora_request", None)
    mm: list[MultiModalInput] = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        offset, length = getattr(position, "offset", None), getattr(position, "length", None)
        if not identifier or not isinstance(offset, int) or not isinstance(length, int) or length <= 0:
            return RequestKeys(None, f"multimodal input without a usable identifier/position: {feature!r}")
        mm.append(MultiModalInput(str(identifier), offset, length))
    if vllm_extra_keys is not None:
        num_tokens = len(getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", ()) or ())
        mm_index = 0
        for start in range(0, num_tokens - block_size + 1, block_size):
            keys, mm_index = vllm_extra_keys(request, start, start + block_size, mm_index)
            for key in keys or ():
                kind = key[0] if isinstance(key, tuple) and key else key
                if kind not in KNOWN_VLLM_KEY_KINDS:
                    return RequestKeys(None, f"vLLM keys this request's blocks by {kind!r}, unknown to kvstrata")
    lora_id, why = (adapters or AdapterKeys()).key(lora) if lora is not None else (None, "")
    if lora is not None and lora_id is None:
        return RequestKeys(None, f"LoRA adapter {getattr(lora, 'lora_name', None)!r} at "
                                 f"{getattr(lora, 'lora_path', None)!r}: {why}")
    if salt is None and lora is None and not mm:
        return RequestKeys(None)
    return RequestKeys(ExtraKeys(cache_salt=salt, lora_id=lora_id, mm_inputs=tuple(mm)))
