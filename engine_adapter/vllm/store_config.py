"""The stores a vLLM engine's connector opens: one per KV cache group and distinct shard.

Every store's namespace identifies what its blocks hold, on every host: the engine and its
version, the content of the weights and the effective model config (`model_identity`), the
KV cache layout, the group's index and spec, the layers it covers, and which shard of a
tensor-parallel group (none where every rank holds the same bytes, as MLA's latent). A worker
opens its own groups' stores; the scheduler opens every worker's, to call a block a hit only
where all of them hold it. Both derive the configs from vLLM's; they must agree exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_adapter.vllm.groups import GroupRule, rule_for
from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.parallel import Place, Shard, every_worker, publish_layers, read_layers, shard_of
from engine_adapter.vllm.settings import ConnectorSettings, store_config
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


def spec_identity(spec: Any) -> dict[str, object]:
    """A vLLM KV cache spec as canonical data: its type and every field."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return {"type": type(spec).__name__, **{k: str(v) if not isinstance(v, (int, str, type(None))) else v
                                            for k, v in sorted(fields.items())}}


@dataclass(frozen=True)
class GroupStore:
    """One KV cache group's store as one worker holds it (`writer`: it saves the group)."""

    group: int
    rule: GroupRule
    config: StoreConfig
    layer_names: tuple[str, ...]
    writer: bool


class StorePlanner:
    """Derives every store's `StoreConfig` from vLLM's config; refuses what it cannot key."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings) -> None:
        import vllm

        self.vllm_config, self.settings = vllm_config, settings
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ConfigError("kvstrata: vLLM gave the connector no KV cache group")
        for i, g in enumerate(groups):
            if getattr(g, "is_eagle_group", False):
                raise ConfigError(f"kvstrata cannot serve KV cache group {i}: it holds a speculative-decoding draft "
                                  "model's layers, whose last block vLLM may rewrite")
        self.specs = [g.kv_cache_spec for g in groups]
        self.layer_names = [list(g.layer_names) for g in groups]
        self.rules = [rule_for(spec, i) for i, spec in enumerate(self.specs)]
        sizes = sorted({r.block_size for r in self.rules})
        if len(sizes) != 1:
            raise ConfigError(f"kvstrata needs one block size across KV cache groups, got {sizes}")
        self.block_size = sizes[0]
        self.places = every_worker(vllm_config)
        self.deployment: dict[str, object] = {
            "engine": "vllm",
            "vllm": vllm.__version__,
            "model": model_identity(vllm_config),
            "layout": str(kv_cache_config.kv_cache_layout),
            "user": settings.namespace,
        }
        # The group whose hit length the load policy and counters follow: the first full one.
        full = [i for i, r in enumerate(self.rules) if r.kind.value == "full"]
        self.primary = full[0] if full else 0

    def _page(self, group: int) -> int:
        """Bytes of one layer's block of `group` as vLLM's tensors expose it (without padding)."""
        spec = self.specs[group]
        return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))

    def _manifest_key(self) -> dict[str, object]:
        """What names one deployment's pipeline-stage manifests (vLLM's layer partition too)."""
        return {**self.deployment, "specs": [spec_identity(s) for s in self.specs],
                "parallel": [self.places[-1].tp_size, self.places[-1].pp_size],
                "partition": os.environ.get("VLLM_PP_LAYER_PARTITION")}

    def _config(self, group: int, layers: list[str], shard: Shard, *, cpu_bytes: int,
                events: bool, saves: bool) -> StoreConfig:
        spec, s = self.specs[group], self.settings
        identity = {**self.deployment, "group": group, "groups": len(self.specs), "spec": spec_identity(spec),
                    "layers": layers, "shard": shard.identity()}
        return store_config(
            s, layout=opaque_layout(len(layers), self._page(group), self.block_size), block_size=self.block_size,
            namespace=json.dumps(identity, sort_keys=True, default=str), cpu_bytes=cpu_bytes, saves=saves,
            publishes=events, head_size=getattr(spec, "head_size", None), kv_dtype=getattr(spec, "dtype", None),
            model_name=str(self.vllm_config.model_config.served_model_name)[:256] or None)

    def worker_stores(self, place: Place, layer_names: list[list[str]] | None = None) -> list[GroupStore]:
        """The stores of the worker at `place` (the groups with layers there), the CPU tier
        split between them by block size. Only the first worker's primary store publishes KV
        events (one publisher per endpoint)."""
        names = self.layer_names if layer_names is None else layer_names
        s = self.settings
        present = [g for g in range(len(self.specs)) if names[g]]
        weights = {g: self._page(g) * len(names[g]) for g in present}
        stores = []
        for g in present:
            share = s.cpu_bytes * weights[g] // sum(weights.values())
            block = opaque_layout(len(names[g]), self._page(g), self.block_size).block_bytes(self.block_size)
            if 0 < share < block:
                raise ConfigError(f"kvstrata: cpu_bytes={s.cpu_bytes} leaves KV cache group {g} less than one "
                                  f"block ({block} bytes); raise cpu_bytes or set it to 0")
            shard = shard_of(self.specs[g], place)
            config = self._config(g, names[g], shard, cpu_bytes=share, events=place.rank == 0 and g == self.primary,
                                  saves=True)
            stores.append(GroupStore(g, self.rules[g], config, tuple(names[g]), shard.writer))
        return stores

    def publish(self, place: Place) -> None:
        """Under pipeline parallelism, record this worker's layers for the scheduler."""
        if place.pp_size > 1 and self.settings.disk_path is not None:
            publish_layers(str(self.settings.disk_path), self._manifest_key(), place, self.layer_names)

    def every_shard(self) -> list[list[StoreConfig]]:
        """Per group, a disk-only view of every distinct shard's store (every stage, every
        distinct tensor shard): what the scheduler checks in multiprocess mode."""
        per_group: list[list[StoreConfig]] = [[] for _ in self.specs]
        seen: set[str] = set()
        for place in self.places:
            names = self.layer_names
            if place.pp_size > 1:
                if self.settings.disk_path is None:
                    raise ConfigError("kvstrata: pipeline parallelism needs disk_path (the scheduler reads every "
                                      "stage's blocks there)")
                names = read_layers(str(self.settings.disk_path), self._manifest_key(), place, len(self.specs))
            for g in range(len(self.specs)):
                if not names[g]:
                    continue
                config = self._config(g, names[g], shard_of(self.specs[g], place), cpu_bytes=0, events=False,
                                      saves=False)
                if config.namespace not in seen:
                    seen.add(config.namespace)
                    per_group[g].append(config)
        return per_group
