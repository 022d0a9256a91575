"""The `StoreConfig` a vLLM engine's connector opens: the namespace that identifies the model's
KV on every host (content of the weights, effective config, dtypes, KV layout) and the tiers
from the connector settings. Both roles derive it; they must agree exactly."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.weights_identity import weights_identity
from kvstore import StoreConfig
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Keys of a HF config that describe where or by what it was saved, not the model.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset")


def model_identity(vllm_config: VllmConfig) -> dict[str, object]:
    """Everything of vLLM's config that changes the KV a model computes, host-independent:
    the weights' content digests, the effective HF config (after `hf_overrides`: RoPE,
    layers, ...), model dtype, quantization, KV cache dtype and scaling."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf_config = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else dict(vars(model.hf_config))
    for key in _CONFIG_NOISE:
        hf_config.pop(key, None)
    return {
        "weights": weights_identity(model.model, model.revision),
        "hf_config": hf_config,
        "model_dtype": str(model.dtype),
        "quantization": model.quantization,
        "override_attention_dtype": getattr(model, "override_attention_dtype", None),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None),
    }


def store_config_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
) -> StoreConfig:
    """The `StoreConfig` both roles derive from vLLM's config (they must agree exactly)."""
    import vllm

    parallel = vllm_config.parallel_config
    if parallel.world_size != 1:
        raise ConfigError(
            f"TierKVConnector supports tensor/pipeline parallel size 1, got world size "
            f"{parallel.world_size}"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"TierKVConnector needs one KV cache group, got {len(groups)}")
    spec = groups[0].kv_cache_spec
    layer_names = list(groups[0].layer_names)
    identity = {
        "engine": "vllm",
        "vllm": vllm.__version__,
        "model": model_identity(vllm_config),
        "layout": str(kv_cache_config.kv_cache_layout),
        "spec": type(spec).__name__,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "head_size_v": getattr(spec, "head_size_v", spec.head_size),
        "dtype": str(spec.dtype),
        "block_size": spec.block_size,
        "page_size_bytes": spec.page_size_bytes,
        "layers": layer_names,
        "user": settings.namespace,
    }
    return StoreConfig(
        layout=opaque_layout(len(layer_names), spec.page_size_bytes, spec.block_size),
        block_size=spec.block_size,
        namespace=json.dumps(identity, sort_keys=True, default=str),
        cpu_bytes=settings.cpu_bytes,
        disk_path=settings.disk_path,
        disk_bytes=settings.disk_bytes,
        hash_algo=settings.hash_algo,
        verify_tokens=settings.verify_tokens,
        disk_sync=settings.disk_sync,
        write_through=settings.write_through and settings.disk_path is not None,
        remote_url=settings.remote_url,
        disk_codec=settings.disk_codec,
        remote_codec=settings.remote_codec,
        codec_dtype=spec.dtype,  # the pages' bytes hold KV of this dtype
        codec_group=spec.head_size,  # a scale per head vector of a token
        events_endpoint=settings.events_endpoint,
        events_replay_endpoint=settings.events_replay_endpoint,
        events_topic=settings.events_topic,
        events_curve_cert=settings.events_curve_cert,
        events_curve_clients=settings.events_curve_clients,
        events_insecure=settings.events_insecure,
        events_connect=settings.events_connect,
        load_policy=settings.load_policy,
        instance_id=settings.instance_id,
        model_name=str(vllm_config.model_config.served_model_name)[:256] or None,
    )
