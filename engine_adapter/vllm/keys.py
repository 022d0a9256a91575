"""What besides token ids changes a vLLM request's KV, as kvstrata `ExtraKeys`.

Mirrors vLLM's own block hashing (`vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`):
the cache salt enters the first block, the LoRA adapter (name and path, plus its int id)
every block, and each multimodal input's identifier every block its placeholder span
overlaps. A request carrying anything else that vLLM mixes into its keys (prompt embeddings,
or a kind of extra key this module does not know) cannot be keyed safely: it is neither
looked up nor saved. Duck-typed over the request object, so it is tested without vLLM too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

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


def lora_key(lora_request: Any) -> str:
    """One string naming an adapter as vLLM's keys do (name and path), plus its int id."""
    return json.dumps(
        [getattr(lora_request, "lora_name", None), getattr(lora_request, "lora_path", None),
         getattr(lora_request, "lora_int_id", None)],
        default=str,
    )


def request_keys(
    request: Any,
    block_size: int,
    vllm_extra_keys: Callable[[Any, int, int, int], tuple[tuple[Any, ...] | None, int]] | None = None,
) -> RequestKeys:
    """The `ExtraKeys` that make `request`'s blocks unique, or a refusal.

    `vllm_extra_keys` is vLLM's `generate_block_hash_extra_keys`; when given, every block's
    extra keys as vLLM computes them are checked to be of kinds this module maps, so a
    feature added to vLLM's keys later is refused rather than silently ignored.
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
    if salt is None and lora is None and not mm:
        return RequestKeys(None)
    return RequestKeys(ExtraKeys(cache_salt=salt, lora_id=lora_key(lora) if lora is not None else None,
                                 mm_inputs=tuple(mm)))
