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


def lora_key(lora_request: Any, identify: Callable[[str], str | None] = adapter_identity) -> str | None:
    """One string naming an adapter by what changes the KV: its files' content (`identify`:
    an adapter retrained into the same directory, same name and id, is another adapter) and
    its weights' layout flag; None if its content cannot be identified. Names, paths and int
    ids are not in it: two engines loading the same bytes share keys."""
    path = getattr(lora_request, "lora_path", None)
    content = identify(path) if isinstance(path, str) and path else None
    if content is None:
        return None
    return json.dumps(["lora", content, bool(getattr(lora_request, "is_3d_lora_weight", False))])


def request_keys(
    request: Any,
    block_size: int,
    vllm_extra_keys: Callable[[Any, int, int, int], tuple[tuple[Any, ...] | None, int]] | None = None,
    identify: Callable[[str], str | None] = adapter_identity,
) -> RequestKeys:
    """The `ExtraKeys` that make `request`'s blocks unique, or a refusal.

    `vllm_extra_keys` is vLLM's `generate_block_hash_extra_keys`; when given, every block's
    extra keys as vLLM computes them are checked to be of kinds this module maps, so a
    feature added to vLLM's keys later is refused rather than silently ignored. `identify`
    names a LoRA adapter's content (`lora_key`).
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
    lora_id = lora_key(lora, identify) if lora is not None else None
    if lora is not None and lora_id is None:
        return RequestKeys(None, f"LoRA adapter {getattr(lora, 'lora_name', None)!r} at "
                                 f"{getattr(lora, 'lora_path', None)!r}: its files cannot be read to identify it")
    if salt is None and lora is None and not mm:
        return RequestKeys(None)
    return RequestKeys(ExtraKeys(cache_salt=salt, lora_id=lora_id, mm_inputs=tuple(mm)))
