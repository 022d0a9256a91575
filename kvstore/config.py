"""Frozen, validated configuration of a store: `StoreConfig` (its tiers, fastest first, and the
store-level settings), `HashAlgo`; the KV layout is `kvstore/layout.py`'s.

A config's tiers are its `tiers` as given, or the sequence its flat tier fields stand for,
checked against its layout. The flat fields are sugar: each enables one built-in tier
(`pool_blocks` > 0 the pool, `cpu_bytes` > 0 the CPU tier, `disk_path` the disk, `remote_url`
the remote), in that order, and a store built from them is the store built from the tier
configs `flat_tiers` returns. Their errors name the flat fields."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from kvstore.codec_config import check_tier_codecs, codec_identity, lossy_codecs, parse_codec_dtype
from kvstore.errors import ConfigError
from kvstore.layout import DTYPES, MAX_DIM, KVLayout, dtype_name
from kvstore.load_policy import LoadPolicyMode
from kvstore.settings import parse_bool, parse_optional_str, parse_str
from kvstore.tier_configs import FLAT_FIELDS, NamedTier, parse_given
from tiers.codecs import CodecConfig, CodecKind, codec_config, parse_codec
from tiers.cpu.config import CPUTierConfig, check_fits
from tiers.disk.config import MAX_DISK_BYTES, DiskTierConfig, check_disk_bytes
from tiers.disk.durability import DiskSync
from tiers.plugins import check_path, is_int_at_least, require_int
from tiers.policies.admission import ADMIT_ALL, AdmissionKind, AdmissionSpec, parse_admission
from tiers.policies.eviction import EvictionKind, eviction_config, parse_eviction
from tiers.pool.config import PoolTierConfig, check_device, parse_demotion
from tiers.pool.gpu_pool import DemotionPolicy
from tiers.remote.config import MAX_TTL_S, RemoteTierConfig, check_timeout
from tiers.remote.url import check_url
from tiers.tier_config import TierConfig

__all__ = ["DTYPES", "MAX_DIM", "MAX_DISK_BYTES", "HashAlgo", "KVLayout", "StoreConfig", "dtype_name",
           "is_int_at_least", "parse_hash_algo", "require_int"]

class HashAlgo(str, enum.Enum):
    """Hash function of the block-hash chain."""

    XXH3_128 = "xxh3_128"  # fast, 128-bit, non-cryptographic (default)
    SHA256 = "sha256"  # collision-resistant, for multi-tenant deployments

    @property
    def digest_bytes(self) -> int:
        return 16 if self is HashAlgo.XXH3_128 else 32


def parse_hash_algo(value: HashAlgo | str) -> HashAlgo:
    try:
        return HashAlgo(value)
    except ValueError:
        raise ConfigError(
            f"hash_algo must be one of {[a.value for a in HashAlgo]}, got {value!r}"
        ) from None


@dataclass(frozen=True)
class StoreConfig:
    """Settings of a `KVCacheStore`, validated at construction.

    Attributes:
        layout: the KV layout every stored tensor must match.
        block_size: tokens per block; only full blocks are cached.
        namespace: model identity (name, revision, ...). It enters every block key together
            with the layout, dtype, block size and hash algorithm, so two configurations
            never share an entry.
        cpu_bytes: capacity of the CPU tier (0 disables it). Pinned when CUDA is present.
        disk_path: directory of the LMDB tier; None disables it.
        disk_bytes: capacity of the LMDB tier, payload pages included.
        hash_algo: `HashAlgo` or its name.
        verify_tokens: keep each block's token ids beside it and treat a hit whose tokens
            differ as a miss (a guard against hash collisions).
        disk_sync: durability of disk-tier writes across a power loss (a killed process
            never loses a committed block in any mode): `DiskSync.COMMIT` (default; each
            store's blocks are synced to the device before it returns), `DiskSync.GROUP`
            (synced by a background thread within 0.2 s) or `DiskSync.NONE` (the kernel
            writes back when it likes). A name or a bool is accepted (True: COMMIT, False:
            NONE); see `tiers/disk/durability.py`.
        write_through: write stored blocks to the disk tier at once as well as to the CPU
            tier (they survive a killed process; CPU eviction costs no write). Otherwise
            blocks reach disk when the CPU tier evicts them, or on `close()`.
        persist_on_close: on `close()`, copy CPU-tier blocks not yet on disk down to it, so
            a reopened store finds everything.
        pool_blocks: blocks in the GPU block pool, tier 0 (0: no pool).
        pool_device: device of the pool's KV tensor (default: CUDA when present, else CPU). A
            pool that is larger than the device's memory, or a device that is absent, raises
            `ConfigError` when the store opens.
        pool_demotion: `DemotionPolicy` or its name: "on_evict" (copy a block down when it is
            reused) or "write_through" (copy it down when it is cached).
        remote_url: a Valkey/Redis server shared by many hosts, the slowest tier:
            `redis://[user:password@]host:port[/db]`, `rediss://` (TLS), `unix:///path.sock`,
            or `redis+cluster://host:port[,host:port...]`; without a password in the URL, the
            store gives the tier `KVSTRATA_REMOTE_PASSWORD` (`kvstore.settings`). Every stored
            block is written to it in the background.
        remote_ttl_s: expire remote records after this many seconds (None: the server's LRU).
        remote_timeout_s: bound on every remote call; a slower server is a miss.
        load_policy: `LoadPolicyMode` or its name: "auto" (load a cached prefix from a tier only where the measured load
            time beats recomputing it at the engine's measured prefill rate), "always", or
            "never" (see `kvstore/load_policy.py`). Engines ask `KVCacheStore.load_policy`.
        retain_share: the share of the memory tier below the engine (the CPU tier) that one
            tenant (namespace and cache salt) may keep with `KVCacheStore.retain` and the "high"
            priority (`KVCacheStore.prioritize`), in (0, 1].
        disk_read_bps: cap the disk tier's reads at this many bytes per second of records as
            stored (encoded, with `disk_codec`; None: no cap); to share a device with other
            work, or to emulate a slower one.
        result_buffer_bytes: idle host memory kept to recycle the tensors `retrieve()`
            returns (pre-faulted, huge pages where the kernel allows): a result dropped by
            the caller is reused instead of faulted in anew. Beyond it, the most recent
            result too large to fit is kept as well (one buffer, at most 1/8 of RAM), so long
            prompts are recycled too. 0: a fresh allocation each time.
        io_threads: threads that run `prefetch` and the asyncio API (`astore`, `aretrieve`,
            `alookup`): at most this many such calls run at once.
        events_endpoint: publish KV events (blocks entering and leaving each tier) in vLLM's
            format on this ZeroMQ endpoint, `tcp://HOST:PORT` or `ipc://PATH`, for
            `kvstrata router`, Dynamo or llm-d (docs/routing.md), e.g.
            `tcp://127.0.0.1:5590`. An address other hosts can reach needs CURVE keys or
            `events_insecure` (docs/security.md). None: no events.
        events_replay_endpoint: where the publisher answers vLLM's replay requests (default:
            the port after `events_endpoint`, or `<path>.replay`).
        events_topic: the ZeroMQ topic of every message (default ""; llm-d's indexer wants
            `kv@<pod>@<model>`).
        events_curve_cert: the publisher's secret ZeroMQ certificate file; with
            `events_curve_clients` (a directory of the readers' public certificates) every
            reader is authenticated and the events are encrypted (docs/security.md).
        events_curve_clients: see `events_curve_cert`.
        events_insecure: allow `events_endpoint` on an address other hosts can reach without
            CURVE (for readers that cannot speak it, as Dynamo and llm-d): anyone who
            connects then reads every block's token ids. Off: such an endpoint is refused.
        events_connect: connect to `events_endpoint` instead of binding it, for a reader that
            binds (llm-d's indexer); no replay endpoint unless `events_replay_endpoint` names
            one.
        instance_id: this engine instance's name in the events (default `HOST:PID`).
        model_name: a short model label for routers to filter on (default: `namespace`,
            cut to 128 characters).
        cpu_checksums: keep an xxh3-64 of every CPU-tier block, checked before the block is
            read or demoted; a block damaged in memory is then a miss (costs one hash per
            block written and per block read).
        cpu_eviction: the CPU tier's eviction policy, `EvictionKind` or its name: "lru"
            (default), "s3fifo", "arc" or "lfu" (`tiers/policies/eviction.py`; measured against LRU and
            Belady's optimum in docs/performance.md). Whatever the policy, a block whose
            children are held is evicted after them where the keys name their parents.
        demote_admission: which blocks the CPU tier, evicting them, writes to the tier below:
            "all" (default), or "seen:N" (N in 2..15): only blocks used at least N times while
            counted by a frequency sketch; the others are dropped, a write (and SSD wear)
            saved. `CPUTier.num_demotions_refused` counts them. Spills on close ignore it.
        cpu_tenant_quota_bytes: a budget per tenant (namespace and cache salt, as the keys
            carry them) in the CPU tier: a tenant over it evicts its own blocks first, and a
            tenant within it keeps its blocks under another tenant's burst (None: no quotas,
            one eviction order for all).
        disk_codec: how the disk tier encodes blocks, `CodecKind` or its name: "none"
            (default), "zstd" (lossless, needs the `codec` extra), or the lossy "int8", "fp8"
            and "k8v4" (8-bit keys and values, or 8-bit keys and 4-bit values; bounds and
            fidelity in docs/performance.md). The pool and CPU tiers hold raw KV. A lossy codec
            enters `identity()`: such a store shares no block with an exact one, in any tier.
        remote_codec: the same for the remote tier.
        codec_dtype: the KV's element dtype when `layout` is opaque uint8 bytes (an engine's
            pages, as the vLLM connector stores them): a lossy codec quantizes the bytes as
            this dtype, and "zstd" splits their byte planes by its size. None: the layout's.
        codec_group: elements per scale of a lossy codec on an opaque layout (default 64; the
            head size keeps a scale to one head vector). Structured layouts scale keys per
            channel and values per head vector instead.
        tiers: the tiers, fastest first, each a tier config (`PoolTierConfig`, `CPUTierConfig`,
            `DiskTierConfig`, `RemoteTierConfig` from `tiers/*_config.py`, or a tier's from
            outside kvstrata), a registered name, or a plain dict `{"type": NAME_OR_CLASS,
            "module_path": "pkg.mod", ...its fields}` (`tiers/plugins.py`). Empty (default):
            the flat tier fields above (`pool_*`, `cpu_*`, `demote_admission`, `disk_*`,
            `remote_*`) build them, the same store; given, those keep their defaults.
    """

    layout: KVLayout
    block_size: int = 16
    namespace: str = "default"
    cpu_bytes: int = 1 << 30
    disk_path: str | os.PathLike[str] | None = None
    disk_bytes: int = 8 << 30
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    verify_tokens: bool = True
    disk_sync: DiskSync | bool | str = DiskSync.COMMIT
    write_through: bool = False
    persist_on_close: bool = True
    pool_blocks: int = 0
    pool_device: str | None = None
    pool_demotion: DemotionPolicy = DemotionPolicy.ON_EVICT
    cpu_checksums: bool = False
    cpu_eviction: EvictionKind = EvictionKind.LRU
    demote_admission: AdmissionSpec = ADMIT_ALL
    cpu_tenant_quota_bytes: int | None = None
    remote_url: str | None = field(default=None, repr=False)  # it may hold a password
    remote_ttl_s: int | None = None
    remote_timeout_s: float = 0.5
    io_threads: int = 4
    result_buffer_bytes: int = 256 << 20
    load_policy: LoadPolicyMode = LoadPolicyMode.AUTO
    retain_share: float = 0.5
    disk_read_bps: int | None = None
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str = ""
    events_curve_cert: str | None = None
    events_curve_clients: str | None = None
    events_insecure: bool = False
    events_connect: bool = False
    instance_id: str | None = None
    model_name: str | None = None
    disk_codec: CodecKind = CodecKind.NONE
    remote_codec: CodecKind = CodecKind.NONE
    codec_dtype: torch.dtype | None = None
    codec_group: int | None = None
    tiers: Sequence[TierConfig | Mapping[str, Any] | str] = ()  # a tuple of TierConfig once built

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"StoreConfig.layout must be a KVLayout, got {self.layout!r}")
        require_int("StoreConfig.block_size", self.block_size, 1, high=MAX_DIM)
        for name in ("verify_tokens", "write_through", "persist_on_close", "cpu_checksums", "events_insecure",
                     "events_connect"):  # never a truthy stand-in: "false" is False, [] an error
            object.__setattr__(self, name, parse_bool(f"StoreConfig.{name}", getattr(self, name)))
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError(f"StoreConfig.namespace must be a non-empty str, got {self.namespace!r}")
        try:
            self.namespace.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"StoreConfig.namespace is not valid UTF-8 text: {exc}") from None
        object.__setattr__(self, "hash_algo", parse_hash_algo(self.hash_algo))
        object.__setattr__(self, "tiers", parse_given(self.tiers))
        if not self.tiers:
            for name, value in _flat_values(self).items():
                object.__setattr__(self, name, value)
        require_int("StoreConfig.io_threads", self.io_threads, 1, high=1024)
        require_int("StoreConfig.result_buffer_bytes", self.result_buffer_bytes, 0)
        object.__setattr__(self, "load_policy", LoadPolicyMode.parse(self.load_policy, "StoreConfig.load_policy"))
        if isinstance(self.retain_share, bool) or not isinstance(self.retain_share, (int, float)) \
                or not 0 < self.retain_share <= 1:
            raise ConfigError(f"StoreConfig.retain_share must be a number in (0, 1], got {self.retain_share!r}")
        object.__setattr__(self, "retain_share", float(self.retain_share))
        parse_str("StoreConfig.events_topic", self.events_topic)
        for name in ("events_replay_endpoint", "events_curve_cert", "events_curve_clients"):
            parse_optional_str(f"StoreConfig.{name}", getattr(self, name))  # even where nothing reads them
        if self.events_endpoint is not None:
            from kvevents import check_events

            check_events(self.events_endpoint, self.events_replay_endpoint, self.events_topic,
                         self.events_curve_cert, self.events_curve_clients, self.events_insecure, "StoreConfig.",
                         self.events_connect)
        for name in ("instance_id", "model_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > 256):
                raise ConfigError(f"StoreConfig.{name} must be a non-empty str of at most 256 characters, "
                                  f"got {value!r}")
        object.__setattr__(self, "codec_dtype", parse_codec_dtype(self.codec_dtype, self.layout.dtype))
        if self.codec_group is not None:
            require_int("StoreConfig.codec_group", self.codec_group, 1)
        object.__setattr__(self, "tier_configs", _store_tiers(self))  # a bad tier is refused here, not on open

    @cached_property
    def tier_configs(self) -> tuple[TierConfig, ...]:
        """The tiers a store of this config opens, fastest first: `tiers`, or the sequence
        the flat tier fields stand for (see the module docstring); built and checked when the
        config is."""
        return _store_tiers(self)

    @property
    def lossy_codecs(self) -> list[str]:
        """The lossy codecs of the tiers, sorted by name (empty: every tier is exact)."""
        return lossy_codecs(self.tier_configs)

    @cached_property
    def block_bytes(self) -> int:
        return self.layout.block_bytes(self.block_size)

    @cached_property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.layout.block_shape(self.block_size)

    @cached_property
    def cpu_blocks(self) -> int:
        return self.cpu_bytes // self.block_bytes

    def identity(self) -> list[object]:
        """What makes two stores' keys comparable: namespace, layout, block size, algorithm,
        and the lossy codecs its tiers write (with the element dtype and group they quantize
        with). Exact stores keep the identity they had before codecs existed."""
        codecs = codec_identity(self.tier_configs, self.codec_dtype, self.codec_group)
        return [self.namespace, *self.layout.identity(), self.block_size, self.hash_algo.value, *codecs]


def _flat_values(c: StoreConfig) -> dict[str, object]:
    """The flat tier fields of `c`, checked (`ConfigError` naming the field) and normalized
    (enums, parsed rules), to be set on it."""
    require_int("StoreConfig.cpu_bytes", c.cpu_bytes, 0)
    check_disk_bytes(c.disk_bytes, "StoreConfig.disk_bytes")
    require_int("StoreConfig.pool_blocks", c.pool_blocks, 0)
    if c.pool_device is not None:
        check_device(c.pool_device, "StoreConfig.pool_device")
    out: dict[str, object] = {
        "pool_demotion": parse_demotion(c.pool_demotion, "StoreConfig.pool_demotion"),
        "disk_sync": DiskSync.parse(c.disk_sync, "StoreConfig.disk_sync"),
        "cpu_eviction": parse_eviction(c.cpu_eviction, "StoreConfig.cpu_eviction"),
    }
    if c.disk_path is not None:
        out["disk_path"] = check_path(c.disk_path, "StoreConfig.disk_path")
        if c.disk_bytes < 2 * c.block_bytes:
            raise ConfigError(f"StoreConfig.disk_bytes={c.disk_bytes} is below two blocks ({2 * c.block_bytes} bytes "
                              f"at block_size={c.block_size})")
    if 0 < c.cpu_bytes < c.block_bytes:
        raise ConfigError(f"StoreConfig.cpu_bytes={c.cpu_bytes} holds no block of {c.block_bytes} bytes "
                          f"(block_size={c.block_size}); use 0 to disable the CPU tier")
    if c.remote_url is not None:
        check_url(c.remote_url)
    if c.remote_ttl_s is not None:
        require_int("StoreConfig.remote_ttl_s", c.remote_ttl_s, 1, high=MAX_TTL_S)
    check_timeout(c.remote_timeout_s, "StoreConfig.remote_timeout_s")
    admission = parse_admission(c.demote_admission, "StoreConfig.demote_admission")
    if admission.kind is AdmissionKind.TINYLFU:
        raise ConfigError("StoreConfig.demote_admission must be 'all' or 'seen:N'; 'tinylfu' compares with "
                          "the lower tier's victim, which the CPU tier does not know")
    out["demote_admission"] = admission
    if c.cpu_tenant_quota_bytes is not None:
        quota = require_int("StoreConfig.cpu_tenant_quota_bytes", c.cpu_tenant_quota_bytes, 1)
        check_fits("StoreConfig.cpu_tenant_quota_bytes", quota, c.block_bytes)
    if c.disk_read_bps is not None:
        require_int("StoreConfig.disk_read_bps", c.disk_read_bps, 1)
    for name in ("disk_codec", "remote_codec"):
        out[name] = parse_codec(getattr(c, name), f"StoreConfig.{name}")
    return out


def flat_tiers(c: StoreConfig) -> list[NamedTier]:
    """The tiers `c`'s flat fields (checked by `flat_values`) enable, fastest first."""
    named: list[NamedTier] = []
    if c.pool_blocks:
        named.append(NamedTier("StoreConfig.pool_blocks", "", PoolTierConfig(
            c.pool_blocks, None if c.pool_device is None else str(c.pool_device), c.pool_demotion)))
    if c.cpu_bytes:
        named.append(NamedTier("StoreConfig.cpu_bytes", "", CPUTierConfig(
            c.cpu_bytes, c.cpu_checksums, eviction_config(c.cpu_eviction), c.demote_admission,
            c.cpu_tenant_quota_bytes)))
    if c.disk_path is not None:
        named.append(NamedTier("StoreConfig.disk_path", "StoreConfig.disk_codec", DiskTierConfig(
            str(c.disk_path), c.disk_bytes, DiskSync.parse(c.disk_sync), c.disk_read_bps, codec_config(c.disk_codec))))
    if c.remote_url is not None:
        named.append(NamedTier("StoreConfig.remote_url", "StoreConfig.remote_codec", RemoteTierConfig(
            c.remote_url, c.remote_ttl_s, c.remote_timeout_s, codec_config(c.remote_codec))))
    return named


def _store_tiers(c: StoreConfig) -> tuple[TierConfig, ...]:
    """The tiers `c` opens, fastest first (see the module docstring). Raises `ConfigError`
    for flat tier fields set beside `tiers`, no tier, an engine's pool below another tier,
    two tiers of one kind, a tier too small for a block, or a codec that cannot encode the
    layout (each naming the tier or field)."""
    if c.tiers:
        defaults = {f.name: f.default for f in dataclasses.fields(c)}
        set_ = [name for name in FLAT_FIELDS if getattr(c, name) != defaults[name]]
        if set_:
            raise ConfigError(f"StoreConfig.tiers is given, and so are the flat tier fields {set_}: give one or "
                              "the other (the flat fields build the tiers only when `tiers` is empty)")
        named = [NamedTier(f"StoreConfig.tiers[{i}]", f"StoreConfig.tiers[{i}].codec", t)
                 for i, t in enumerate(parse_given(c.tiers))]  # parsed already: the configs pass through
    else:
        named = flat_tiers(c)
    if not named:
        raise ConfigError("StoreConfig enables no tier: set pool_blocks, cpu_bytes, disk_path or remote_url, "
                          "or give tiers")
    kinds: dict[str, str] = {}
    for i, t in enumerate(named):
        tier = t.config.tier
        if tier.traits.engine_memory and i:
            raise ConfigError(f"{t.what}: a {tier.kind.value!r} tier holds the engine's paged KV; it must be "
                              "the first tier")
        if tier.kind in kinds:
            raise ConfigError(f"{t.what}: a second {tier.kind.value!r} tier (the first is {kinds[tier.kind]})")
        kinds[tier.kind] = t.what
        t.config.check(c.block_bytes, t.what)
        if t.config.codec is not None and not isinstance(t.config.codec, CodecConfig):
            raise ConfigError(f"{t.codec_what or t.what + '.codec'} must be a codec config (a tier config turns "
                              f"what it is given into one with tiers.codecs.codec_config), got {t.config.codec!r}")
    check_tier_codecs([(t.codec_what or f"{t.what}.codec", t.config.codec) for t in named], c.block_shape,
                      c.layout.dtype, c.codec_dtype, c.codec_group)
    return tuple(t.config for t in named)
