"""The stores a vLLM engine's connector opens: one per KV cache group and distinct shard.

Every store's namespace identifies what its blocks hold, on every host: the engine and its
version, the content of the weights and the effective model config (`model_identity`), the
KV cache layout, the group's index and spec, the layers it covers, and which shard of a
tensor-parallel group (none where every rank holds the same bytes, as MLA's latent). A worker
opens its own groups' stores; the scheduler opens every worker's, to call a block a hit only
where all of them hold it. Both derive the configs from vLLM's; they must agree exactly.
Each config is the library settings passed through, plus what the connector derives
(`group_config`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from engine_adapter.vllm.groups import GroupRule, check_speculation, rule_for
from engine_adapter.vllm.paged_blocks import opaque_layout
from engine_adapter.vllm.parallel import Place, Shard, every_worker, publish_layers, read_layers, shard_of
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.weights_identity import weights_identity
from kvstore import KVLayout, StoreConfig
from kvstore.errors import ConfigError
from tiers.codecs import CodecKind, RawConfig
from tiers.tier_config import TierConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# Keys of a HF config that describe where or by what it was saved, not the model.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset")


# vLLM (0.32) load formats that read the weights from the checkpoint files `weights_identity`
# digests. Any other cannot be told apart by content, and its namespace is the engine
# instance's own: `dummy` (random weights), `tensorizer`, `ipc_cache`, `modelexpress`, plugins
# (bytes from elsewhere), `npcache` (reads `np/` arrays it built once and never refreshes).
CONTENT_LOAD_FORMATS = frozenset({"auto", "hf", "pt", "safetensors", "fastsafetensors", "instanttensor", "mistral",
                                  "sharded_state", "runai_streamer", "runai_streamer_sharded"})


def _weights(vllm_config: VllmConfig) -> list[object]:
    """The weights' identity: the checkpoint's content digests under a load format that reads
    them (with the format: `pt` and `safetensors` may read different files of one directory),
    else this engine instance's id (shared by its scheduler and workers, by no other engine)."""
    model, load = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load, "load_format", "auto")).lower()
    if load_format in CONTENT_LOAD_FORMATS:
        return [load_format, weights_identity(model.model, model.revision)]
    instance = getattr(vllm_config, "instance_id", "")
    if not instance:
        raise ConfigError(f"load format {load_format!r} does not read the checkpoint kvstrata can identify, and "
                          "vLLM's config has no instance id to key this engine's own KV by")
    logger.warning("kvstrata: load format %r does not read the checkpoint's files, so its weights cannot be "
                   "identified by content: this engine's KV is keyed by its instance (%s) and shared with no "
                   "other engine or restart", load_format, instance)
    return [load_format, "instance", instance]


def model_identity(vllm_config: VllmConfig) -> dict[str, object]:
    """Everything of vLLM's config that changes the KV a model computes, host-independent:
    the weights (`_weights`: their content digests, and the load format), the effective HF
    config (after `hf_overrides`: RoPE, layers, ...), model dtype, quantization, KV cache dtype
    and scaling."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf_config = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else dict(vars(model.hf_config))
    for key in _CONFIG_NOISE:
        hf_config.pop(key, None)
    return {
        "weights": _weights(vllm_config),
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


# What of a memory tier the worker splits between its stores: its capacity, and a tenant's
# budget in it (each store holds that share of every block's bytes). Flat fields, tier fields.
SPLIT_FLAT = ("cpu_bytes", "cpu_tenant_quota_bytes")
SPLIT_TIER = ("capacity_bytes", "tenant_quota_bytes")


@dataclass(frozen=True)
class Derived:
    """What the connector derives for one store from vLLM's config.

    Attributes:
        layout, block_size, namespace, model_name: the `StoreConfig` fields of those names.
        memory_share: the store's share of each memory tier (the worker's stores split them by
            block bytes); 0: a view without memory tiers (vLLM's scheduler in another process).
        saves: the store writes (else a read-only view: no write-through).
        publishes: it publishes the KV events (one store per endpoint).
        head_size, kv_dtype: of an attention group, for its lossy codecs; None for a state
            group (Mamba, linear attention), which never takes a lossy codec: its error would
            carry through every later token, so it keeps exact bytes (a lossless codec still
            applies).
        what: how errors name the store ("KV cache group 1").
    """

    layout: KVLayout
    block_size: int
    namespace: str
    model_name: str | None = None
    memory_share: Fraction = Fraction(1)
    saves: bool = True
    publishes: bool = True
    head_size: int | None = None
    kv_dtype: torch.dtype | None = None
    what: str = "the store"


def group_config(settings: ConnectorSettings, d: Derived) -> StoreConfig:
    """A store's `StoreConfig`: the library settings passed through (`settings.library`), as
    they are, but for what the connector derives (`d`): the layout, block size, namespace and
    model name; the store's share of the memory tiers; write-through only where it saves;
    events only where it publishes; a state group's lossy codecs made raw, an attention
    group's quantizing as its KV dtype in runs of one head vector. Raises `ConfigError` where
    the share leaves a memory tier less than one block, or `StoreConfig` refuses the result."""
    values = dict(settings.library)
    values.update(layout=d.layout, block_size=d.block_size, namespace=d.namespace, model_name=d.model_name)
    block = d.layout.block_bytes(d.block_size)
    if d.head_size is not None:
        values.update(codec_dtype=d.kv_dtype, codec_group=d.head_size)
    if settings.library.get("tiers"):
        values["tiers"] = _group_tiers(settings.tier_configs, d, block)
    else:
        if d.memory_share:
            values.update({name: _share(name, settings.value(name), d, block) for name in SPLIT_FLAT})
        else:
            values.update(cpu_bytes=0, cpu_tenant_quota_bytes=None)  # a view: no CPU tier
        if d.head_size is None:
            for name in ("disk_codec", "remote_codec"):
                codec = settings.value(name)
                values[name] = CodecKind.NONE if isinstance(codec, CodecKind) and codec.lossy else codec
    values["write_through"] = d.saves and settings.write_through
    if not d.publishes:
        values.update(events_endpoint=None, events_replay_endpoint=None)
    return StoreConfig(**values)  # type: ignore[arg-type]


def _share(what: str, value: object, d: Derived, block: int) -> object:
    """`value` bytes of a memory tier cut to the store's share (None and 0 stay as they
    are); a share below one block is a `ConfigError` naming `what`."""
    if not isinstance(value, int) or value == 0:
        return value
    share = int(value * d.memory_share)
    if share < block:
        raise ConfigError(f"kvstrata: {what}={value} leaves {d.what} less than one block ({block} bytes; its "
                          f"share is {d.memory_share}); raise {what}, or set no memory tier")
    return share


def _group_tiers(tiers: tuple[TierConfig, ...], d: Derived, block: int) -> tuple[TierConfig, ...]:
    """`tiers` for one store: memory tiers cut to its share (none in a view), a state group's
    lossy codecs made raw."""
    out = []
    for i, t in enumerate(tiers):
        traits = t.tier.traits
        if traits.memory and not traits.shared:
            if not d.memory_share:
                continue
            fields = {f.name for f in dataclasses.fields(t)}
            cut = {name: _share(f"tiers[{i}].{name}", getattr(t, name), d, block) for name in SPLIT_TIER
                   if name in fields and getattr(t, name) is not None}
            t = dataclasses.replace(t, **cut)
        if d.head_size is None and t.codec is not None and t.codec.lossy:
            if "codec" not in {f.name for f in dataclasses.fields(t)}:
                raise ConfigError(f"kvstrata: tiers[{i}] writes the lossy codec {t.codec.kind.label!r}, which "
                                  f"{d.what} (a state group) cannot take, and has no `codec` field to make it exact")
            t = dataclasses.replace(t, **{"codec": RawConfig()})
        out.append(t)
    if not out:
        raise ConfigError(f"kvstrata: {d.what} has no tier but memory tiers, and none of them here")
    return tuple(out)


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
        speculation = getattr(vllm_config, "speculative_config", None)
        check_speculation(getattr(speculation, "method", None) if speculation is not None else None)
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

    def _config(self, group: int, layers: list[str], shard: Shard, *, memory_share: Fraction,
                events: bool, saves: bool) -> StoreConfig:
        spec = self.specs[group]
        identity = {**self.deployment, "group": group, "groups": len(self.specs), "spec": spec_identity(spec),
                    "layers": layers, "shard": shard.identity()}
        return group_config(self.settings, Derived(
            layout=opaque_layout(len(layers), self._page(group), self.block_size), block_size=self.block_size,
            namespace=json.dumps(identity, sort_keys=True, default=str),
            model_name=str(self.vllm_config.model_config.served_model_name)[:256] or None,
            memory_share=memory_share, saves=saves, publishes=events, head_size=getattr(spec, "head_size", None),
            kv_dtype=getattr(spec, "dtype", None), what=f"KV cache group {group}"))

    def worker_stores(self, place: Place, layer_names: list[list[str]] | None = None) -> list[GroupStore]:
        """The stores of the worker at `place` (the groups with layers there), the memory
        tiers split between them by block size. Only the first worker's primary store
        publishes KV events (one publisher per endpoint)."""
        names = self.layer_names if layer_names is None else layer_names
        present = [g for g in range(len(self.specs)) if names[g]]
        weights = {g: self._page(g) * len(names[g]) for g in present}
        stores = []
        for g in present:
            shard = shard_of(self.specs[g], place)
            config = self._config(g, names[g], shard, memory_share=Fraction(weights[g], sum(weights.values())),
                                  events=place.rank == 0 and g == self.primary, saves=True)
            stores.append(GroupStore(g, self.rules[g], config, tuple(names[g]), shard.writer))
        return stores

    def publish(self, place: Place) -> None:
        """Under pipeline parallelism, record this worker's layers for the scheduler."""
        if place.pp_size > 1 and self.settings.disk_dir is not None:
            publish_layers(self.settings.disk_dir, self._manifest_key(), place, self.layer_names)

    def every_shard(self) -> list[list[StoreConfig]]:
        """Per group, a disk-only view of every distinct shard's store (every stage, every
        distinct tensor shard): what the scheduler checks in multiprocess mode."""
        per_group: list[list[StoreConfig]] = [[] for _ in self.specs]
        seen: set[str] = set()
        for place in self.places:
            names = self.layer_names
            if place.pp_size > 1:
                disk = self.settings.disk_dir
                if disk is None:
                    raise ConfigError("kvstrata: pipeline parallelism needs a disk tier (disk_path, or a disk in "
                                      "tiers): the scheduler reads every stage's blocks there")
                names = read_layers(disk, self._manifest_key(), place, len(self.specs))
            for g in range(len(self.specs)):
                if not names[g]:
                    continue
                config = self._config(g, names[g], shard_of(self.specs[g], place), memory_share=Fraction(0),
                                      events=False, saves=False)
                if config.namespace not in seen:
                    seen.add(config.namespace)
                    per_group[g].append(config)
        return per_group
