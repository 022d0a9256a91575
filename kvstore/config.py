"""Frozen, validated configuration: the KV layout and the store's settings."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.load_policy import LoadPolicyMode
from kvstore.settings import MAX_INT, parse_bool, parse_optional_str, parse_str
from tiers.admission import ADMIT_ALL, AdmissionKind, AdmissionSpec, parse_admission
from tiers.codecs import CodecKind
from tiers.disk_durability import DiskSync
from tiers.eviction import EvictionKind, parse_eviction
from tiers.gpu_pool import DemotionPolicy

# dtypes a KV cache is held in. uint8 covers engines whose blocks are opaque bytes.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


MAX_DISK_BYTES = 1 << 44  # 16 TiB: the LMDB map (twice the budget) stays inside the address space
MAX_DIM = 1 << 31  # bound on a layout's dimensions and a block's tokens: what no KV cache comes near


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical short name of a supported torch dtype ('bfloat16', ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")
    return name


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
class KVLayout:
    """Shape and dtype of one token's KV: `num_layers` x (K, V) x `num_kv_heads` x `head_dim`.

    A block of `block_size` tokens is the tensor `[num_layers, 2, block_size, num_kv_heads,
    head_dim]`; `dtype` may be given as a torch dtype or its name.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1) or value > MAX_DIM:
                raise ConfigError(f"KVLayout.{name} must be an int in [1, {MAX_DIM}], got {value!r}")
        dtype = self.dtype
        if isinstance(dtype, str):
            if dtype.removeprefix("torch.") not in _DTYPES:
                raise ConfigError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
            object.__setattr__(self, "dtype", _DTYPES[dtype.removeprefix("torch.")])
        elif isinstance(dtype, torch.dtype):
            dtype_name(dtype)
        else:
            raise ConfigError(f"KVLayout.dtype must be a torch.dtype or name, got {dtype!r}")

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token, K and V of every layer together."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        return self.token_bytes * block_size

    def identity(self) -> list[object]:
        """Canonical, hashable description that enters every block key."""
        return [self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_name]


def is_int_at_least(value: object, low: int) -> bool:
    """Whether `value` is an int (NumPy ints included, bools not) of at least `low`."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= low)


def require_int(name: str, value: object, low: int, error: type[Exception] = ConfigError, high: int = MAX_INT) -> int:
    """`value` as an int in [low, high] (never a bool or a float), else `error` naming it: the
    one check of every count, size and index kvstrata takes from a caller."""
    if not is_int_at_least(value, low) or value > high:  # type: ignore[operator]
        bound = ("> 0" if low == 1 else f">= {low}") if high == MAX_INT else f"in [{low}, {high}]"
        raise error(f"{name} must be an int {bound}, got {value!r}")
    assert isinstance(value, (int, np.integer))
    return int(value)


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
            NONE); see `tiers/disk_durability.py`.
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
            (default), "s3fifo", "arc" or "lfu" (`tiers/eviction.py`; measured against LRU and
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

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"StoreConfig.layout must be a KVLayout, got {self.layout!r}")
        require_int("StoreConfig.block_size", self.block_size, 1, high=MAX_DIM)
        require_int("StoreConfig.cpu_bytes", self.cpu_bytes, 0)
        require_int("StoreConfig.disk_bytes", self.disk_bytes, 1, high=MAX_DISK_BYTES)
        require_int("StoreConfig.pool_blocks", self.pool_blocks, 0)
        for name in ("verify_tokens", "write_through", "persist_on_close", "cpu_checksums", "events_insecure",
                     "events_connect"):  # never a truthy stand-in: "false" is False, [] an error
            object.__setattr__(self, name, parse_bool(f"StoreConfig.{name}", getattr(self, name)))
        if self.pool_device is not None:
            try:
                if not isinstance(self.pool_device, (str, torch.device)):
                    raise TypeError(f"a str or torch.device, not {type(self.pool_device).__name__}")
                if torch.device(self.pool_device).type == "meta":
                    raise ValueError("meta tensors hold no data")
            except (RuntimeError, TypeError, ValueError) as exc:
                raise ConfigError(f"StoreConfig.pool_device={self.pool_device!r} is not a device: {exc}") from None
        try:
            object.__setattr__(self, "pool_demotion", DemotionPolicy(self.pool_demotion))
        except ValueError:
            raise ConfigError(
                f"StoreConfig.pool_demotion must be 'on_evict' or 'write_through', got {self.pool_demotion!r}"
            ) from None
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError(f"StoreConfig.namespace must be a non-empty str, got {self.namespace!r}")
        try:
            self.namespace.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"StoreConfig.namespace is not valid UTF-8 text: {exc}") from None
        object.__setattr__(self, "hash_algo", parse_hash_algo(self.hash_algo))
        object.__setattr__(self, "disk_sync", DiskSync.parse(self.disk_sync, "StoreConfig.disk_sync"))
        if self.disk_path is not None:
            try:
                path = os.fspath(self.disk_path)
            except TypeError:
                raise ConfigError(f"StoreConfig.disk_path must be a path, got {self.disk_path!r}") from None
            if not isinstance(path, str) or not path or "\x00" in path:
                raise ConfigError(f"StoreConfig.disk_path must be a non-empty path without NUL bytes, got {path!r}")
            object.__setattr__(self, "disk_path", path)
        if 0 < self.cpu_bytes < self.block_bytes:
            raise ConfigError(
                f"StoreConfig.cpu_bytes={self.cpu_bytes} holds no block of {self.block_bytes} "
                "bytes; use 0 to disable the CPU tier"
            )
        if self.disk_path is not None and self.disk_bytes < 2 * self.block_bytes:
            raise ConfigError(
                f"StoreConfig.disk_bytes={self.disk_bytes} is below two blocks "
                f"({2 * self.block_bytes} bytes)"
            )
        if self.remote_url is not None:
            from tiers.remote import check_url

            check_url(self.remote_url)
        if self.remote_ttl_s is not None:
            require_int("StoreConfig.remote_ttl_s", self.remote_ttl_s, 1, high=1 << 32)
        if not isinstance(self.remote_timeout_s, (int, float)) or isinstance(self.remote_timeout_s, bool) \
                or not 0 < self.remote_timeout_s <= 60:
            raise ConfigError(f"StoreConfig.remote_timeout_s must be in (0, 60] seconds, got {self.remote_timeout_s!r}")
        object.__setattr__(self, "cpu_eviction", parse_eviction(self.cpu_eviction, "StoreConfig.cpu_eviction"))
        admission = parse_admission(self.demote_admission, "StoreConfig.demote_admission")
        if admission.kind is AdmissionKind.TINYLFU:
            raise ConfigError("StoreConfig.demote_admission must be 'all' or 'seen:N'; 'tinylfu' compares with "
                              "the lower tier's victim, which the CPU tier does not know")
        object.__setattr__(self, "demote_admission", admission)
        if self.cpu_tenant_quota_bytes is not None:
            quota = require_int("StoreConfig.cpu_tenant_quota_bytes", self.cpu_tenant_quota_bytes, 1)
            if quota < self.block_bytes:
                raise ConfigError(f"StoreConfig.cpu_tenant_quota_bytes={quota} holds no block of "
                                  f"{self.block_bytes} bytes")
        require_int("StoreConfig.io_threads", self.io_threads, 1, high=1024)
        require_int("StoreConfig.result_buffer_bytes", self.result_buffer_bytes, 0)
        object.__setattr__(self, "load_policy", LoadPolicyMode.parse(self.load_policy, "StoreConfig.load_policy"))
        if self.disk_read_bps is not None:
            require_int("StoreConfig.disk_read_bps", self.disk_read_bps, 1)
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
        from kvstore.codec_config import check_codecs

        check_codecs(self)
        if self.pool_blocks == 0 and self.cpu_bytes == 0 and self.disk_path is None and self.remote_url is None:
            raise ConfigError("StoreConfig enables no tier: set pool_blocks, cpu_bytes, disk_path or remote_url")

    @property
    def lossy_codecs(self) -> list[str]:
        """The lossy codecs of the enabled tiers, sorted by name (empty: every tier is exact)."""
        from kvstore.codec_config import lossy_codecs

        return lossy_codecs(self)

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
        and the lossy codecs a store reads blocks through (with the element dtype and group
        they quantize with). Exact stores keep the identity they had before codecs existed."""
        from kvstore.codec_config import codec_identity

        return [self.namespace, *self.layout.identity(), self.block_size, self.hash_algo.value, *codec_identity(self)]
