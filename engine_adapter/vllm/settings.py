"""The vLLM connector's settings, and the one mapping from them to a store's `StoreConfig`.

Each field is a `kv_connector_extra_config` key and the variable `KVSTRATA_<KEY upper-case>`
(the key wins). The connector refuses an unknown key, and an unknown `KVSTRATA_*` variable
other than the library's (`kvstore.settings.LibrarySettings`) and the families the tests and
benchmarks own (`KVSTRATA_TEST_*`, `KVSTRATA_BENCH_*`). docs/configuration.md is the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvevents import check_events
from kvstore.config import HashAlgo, KVLayout, StoreConfig, parse_hash_algo
from kvstore.errors import ConfigError
from kvstore.load_policy import LoadPolicyMode
from kvstore.settings import (
    ENV_PREFIX,
    EnvSettings,
    LibrarySettings,
    parse_bool,
    parse_bytes,
    parse_optional_int,
    parse_optional_str,
    parse_path,
    parse_str,
    shown,
)
from tiers.codecs import CodecKind, parse_codec
from tiers.disk_durability import DiskSync
from tiers.remote_url import check_url

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_PREFIX", "ConnectorSettings", "parse_bool", "parse_bytes", "store_config"]


@dataclass(frozen=True)
class ConnectorSettings(EnvSettings):
    """The connector's settings. A field that `StoreConfig` also has keeps its default unless
    the field says why the connector's differs.

    Attributes:
        cpu_bytes: CPU-tier capacity in the worker (0 disables it), split between the KV cache
            groups' stores.
        disk_path: LMDB directory; shared by every engine and process that names it. Needed
            when vLLM's scheduler and worker run in different processes.
        disk_bytes: disk-tier capacity.
        disk_read_bps: cap the disk tier's reads at this many bytes per second (e.g. "50MiB";
            None: no cap), to leave a shared device's bandwidth to other work; the load policy
            measures the capped rate.
        hash_algo: `xxh3_128` (default) or `sha256`.
        namespace: extra text mixed into every key (e.g. a checkpoint revision the model
            path does not show). Default "" where `StoreConfig`'s is "default": the connector
            derives the model's identity from vLLM's config and adds this text to it.
        write_through: write each saved block to disk at once (survives a killed engine, and
            other processes see it at once); otherwise on CPU-tier eviction or shutdown.
            Default true where `StoreConfig`'s is false: vLLM's scheduler may run in another
            process, and it sees only what is on disk.
        disk_sync: durability of disk writes (only matters for power loss): `none` (the
            kernel writes back when it likes; also `false`), `group` (synced in the background
            every 0.2 s) or `commit` (synced before each save returns; also `true`). Default
            `none` where `StoreConfig`'s is `commit`: with `write_through` every engine step's
            saves would wait for the device, and a killed engine loses nothing in any mode.
        verify_tokens: keep token ids beside each block; a hit whose tokens differ is a miss.
        stats_path: if set, the worker keeps a JSON file of its load/save counters here.
        remote_url: a Valkey/Redis server or cluster shared by engines on many hosts (its
            password: in the URL or `KVSTRATA_REMOTE_PASSWORD`).
        disk_codec: how the disk tier encodes blocks: "none", "zstd" (lossless, needs the
            `codec` extra), or the lossy "int8", "fp8", "k8v4" (quantized as the attention's
            KV dtype in runs of one head vector; docs/performance.md). A lossy codec gives
            the engine's KV a namespace of its own: exact engines never read its blocks. A
            state group (Mamba, linear attention) keeps exact bytes.
        remote_codec: the same for the remote tier.
        events_endpoint: publish the worker's KV events (vLLM's format) here for `kvstrata
            router`, Dynamo or llm-d, e.g. `tcp://127.0.0.1:5590` (docs/routing.md).
        events_replay_endpoint: where replay requests are answered (default: the next port).
        events_topic: the ZeroMQ topic of the events (default ""; llm-d wants
            `kv@<pod>@<model>`).
        events_curve_cert: the events publisher's secret ZeroMQ certificate; with
            `events_curve_clients` (a directory of readers' public certificates) readers are
            authenticated and the events encrypted (docs/security.md).
        events_curve_clients: see `events_curve_cert`.
        events_insecure: allow an events endpoint other hosts can reach without CURVE (for
            Dynamo and llm-d, which cannot speak it); refused otherwise.
        events_connect: connect to `events_endpoint` instead of binding it (for a reader that
            binds, as llm-d's indexer).
        instance_id: this engine's name in its KV events (default `HOST:PID`).
        async_saves: write saved blocks to the tiers on a background thread (the step only
            copies them out of vLLM into buffers of their own).
        async_loads: a hit that reads disk or a remote tier is loaded in the background while
            the request waits outside vLLM's steps (other requests keep running); hits held
            in memory are loaded in the step.
        load_policy: "auto" (load a hit only where that beats recomputing it at the measured
            rates; the worker reports vLLM's prefill rate), "always" or "never".
        metrics_port: serve the worker store's Prometheus metrics on this port (needs the
            `metrics` extra); None: none served.
        metrics_host: the address `metrics_port` binds (loopback by default; "0.0.0.0" to let
            other hosts scrape it: the metrics carry no token ids and no authentication).
    """

    SHARED: ClassVar[tuple[type[EnvSettings], ...]] = (LibrarySettings,)
    KEYS_NAME: ClassVar[str] = "kv_connector_extra_config keys"

    cpu_bytes: int = 1 << 30
    disk_path: str | None = None
    disk_bytes: int = 8 << 30
    disk_read_bps: int | None = None
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    namespace: str = ""
    write_through: bool = True
    disk_sync: DiskSync = DiskSync.NONE
    verify_tokens: bool = True
    stats_path: str | None = None
    remote_url: str | None = field(default=None, repr=False)  # it may hold a password
    disk_codec: CodecKind = CodecKind.NONE
    remote_codec: CodecKind = CodecKind.NONE
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str = ""
    events_curve_cert: str | None = None
    events_curve_clients: str | None = None
    events_insecure: bool = False
    events_connect: bool = False
    instance_id: str | None = None
    async_saves: bool = True
    async_loads: bool = True
    load_policy: LoadPolicyMode = LoadPolicyMode.AUTO
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cpu_bytes", parse_bytes("cpu_bytes", self.cpu_bytes))
        set_(self, "disk_bytes", parse_bytes("disk_bytes", self.disk_bytes))
        if self.disk_read_bps is not None:
            set_(self, "disk_read_bps", parse_bytes("disk_read_bps", self.disk_read_bps))
            if self.disk_read_bps == 0:
                raise ConfigError("disk_read_bps must be > 0 bytes per second (None: no cap), got 0")
        set_(self, "hash_algo", parse_hash_algo(self.hash_algo))
        set_(self, "disk_sync", DiskSync.parse(self.disk_sync, "disk_sync"))
        set_(self, "load_policy", LoadPolicyMode.parse(self.load_policy, "load_policy"))
        for name in ("disk_codec", "remote_codec"):
            set_(self, name, parse_codec(getattr(self, name), name))
        for name in ("write_through", "verify_tokens", "async_saves", "async_loads", "events_insecure",
                     "events_connect"):
            set_(self, name, parse_bool(name, getattr(self, name)))
        for name in ("disk_path", "stats_path"):
            set_(self, name, parse_path(name, getattr(self, name)))
        parse_str("namespace", self.namespace)
        parse_str("events_topic", self.events_topic)
        for name in ("events_endpoint", "events_replay_endpoint", "events_curve_cert", "events_curve_clients"):
            parse_optional_str(name, getattr(self, name))  # their types always, even where nothing reads them
        if self.remote_url is not None:
            check_url(self.remote_url)  # its errors show the URL redacted: never the password
        if self.events_endpoint is not None:
            check_events(self.events_endpoint, self.events_replay_endpoint, self.events_topic,
                         self.events_curve_cert, self.events_curve_clients, self.events_insecure,
                         connect=self.events_connect)
        if self.instance_id is not None:
            parse_str("instance_id", self.instance_id, empty=False)
        set_(self, "metrics_port", parse_optional_int("metrics_port", self.metrics_port, 1, 65535))
        host = parse_str("metrics_host", self.metrics_host, empty=False)
        if any(c.isspace() for c in host):
            raise ConfigError(f"metrics_host must be a host name or address, got {shown(host)}")
        if self.cpu_bytes == 0 and self.disk_path is None and self.remote_url is None:
            raise ConfigError("the connector enables no tier: set cpu_bytes > 0, disk_path or remote_url")


def store_config(s: ConnectorSettings, *, layout: KVLayout, block_size: int, namespace: str, cpu_bytes: int,
                 saves: bool, publishes: bool, head_size: int | None, kv_dtype: torch.dtype | None,
                 model_name: str | None) -> StoreConfig:
    """The one mapping from the connector's settings to a store's `StoreConfig`, given what the
    engine derives: the store's opaque `layout`, `block_size` and `namespace` (its identity),
    its share of `cpu_bytes`; `saves`: the store writes (else a read-only view: no write-through);
    `publishes`: it publishes the KV events; `head_size` and `kv_dtype` of an attention group
    (None for a state group, which never takes a lossy codec: its error would carry through
    every later token, so it keeps exact bytes, a lossless codec still applying)."""
    if head_size is None:
        codecs: dict[str, object] = {"disk_codec": _lossless_only(s.disk_codec),
                                     "remote_codec": _lossless_only(s.remote_codec)}
    else:
        codecs = {"disk_codec": s.disk_codec, "remote_codec": s.remote_codec, "codec_dtype": kv_dtype,
                  "codec_group": head_size}
    return StoreConfig(
        layout=layout, block_size=block_size, namespace=namespace, cpu_bytes=cpu_bytes,
        disk_path=s.disk_path, disk_bytes=s.disk_bytes, disk_read_bps=s.disk_read_bps, hash_algo=s.hash_algo,
        verify_tokens=s.verify_tokens,
        disk_sync=s.disk_sync, write_through=saves and s.write_through and s.disk_path is not None,
        remote_url=s.remote_url, **codecs,  # type: ignore[arg-type]
        events_endpoint=s.events_endpoint if publishes else None,
        events_replay_endpoint=s.events_replay_endpoint if publishes else None,
        events_topic=s.events_topic, events_curve_cert=s.events_curve_cert,
        events_curve_clients=s.events_curve_clients, events_insecure=s.events_insecure,
        events_connect=s.events_connect, load_policy=s.load_policy, instance_id=s.instance_id, model_name=model_name,
    )


def _lossless_only(codec: CodecKind) -> CodecKind:
    """`codec` where it is exact, else the raw codec."""
    return CodecKind.NONE if codec.lossy else codec
