"""Every setting kvstrata reads from outside code: one frozen, typed object, one parser.

A setting is either a *key*, given in the vLLM connector's `kv_connector_extra_config` or as
the environment variable `KVSTRATA_<KEY upper-case>`, or *environment only*
(`KVSTRATA_<NAME>`, never a connector key: secrets, benchmark and test switches). A key given
in the extra config wins over its variable, which wins over the default. Unknown keys and
unknown `KVSTRATA_*` variables are refused with a message naming the known ones, so a typo
is never silently ignored. `docs/configuration.md` is the table (`Settings.table()` writes
it; a test keeps the two equal).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.config import HashAlgo, parse_hash_algo
from kvstore.errors import ConfigError
from kvstore.events_wire import check_events
from tiers.codecs import CodecKind, parse_codec

ENV_PREFIX = "KVSTRATA_"
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_ENV = {"env_only": True}


def parse_bytes(name: str, value: object) -> int:
    """An int, or a string like "512MiB", "4G", "1048576" (K/M/G/T are powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * int(1024 ** " KMGT".index(m.group(2).upper() or " "))
    raise ConfigError(f"{name} must be a byte count such as 1073741824 or '1GiB', got {value!r}")


def parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{name} must be a bool (true/false/1/0), got {value!r}")


def _optional_int(name: str, value: object, low: int, high: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not low <= number <= high or (
            isinstance(value, float) and value != number):
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return int(number)


@dataclass(frozen=True)
class Settings:
    """kvstrata's settings (see the module docstring for where each comes from).

    Attributes (connector keys):
        cpu_bytes: CPU-tier capacity in the worker (0 disables it).
        disk_path: LMDB directory; shared by every engine and process that names it. Needed
            when vLLM's scheduler and worker run in different processes.
        disk_bytes: disk-tier capacity.
        hash_algo: `xxh3_128` (default) or `sha256`.
        namespace: extra text mixed into every key (e.g. a checkpoint revision the model
            path does not show).
        write_through: write each saved block to disk at once (survives a killed engine, and
            other processes see it at once); otherwise on CPU-tier eviction or shutdown.
        disk_sync: fsync every LMDB commit (only matters for power loss).
        verify_tokens: keep token ids beside each block; a hit whose tokens differ is a miss.
        stats_path: if set, the worker keeps a JSON file of its load/save counters here.
        remote_url: a Valkey/Redis server or cluster shared by engines on many hosts.
        disk_codec: how the disk tier encodes blocks: "none", "zstd" (lossless, needs the
            `codec` extra), or the lossy "int8", "fp8", "k8v4" (quantized as the attention's
            KV dtype in runs of one head vector; docs/performance.md). A lossy codec gives
            the engine's KV a namespace of its own: exact engines never read its blocks.
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

    Attributes (environment only):
        remote_password: the remote tier's password when the URL has none (never logged).
        results: where benchmarks write their JSON and plots.
        require_redis: tests: a missing `redis-server` fails the remote-tier tests (CI).
        require_vllm: tests: a missing vLLM fails the connector's tests (CI).
        require_dynamo: tests: a missing Dynamo indexer (`.venv-dynamo`) fails its tests (CI).
        test_pool_device: tests: the block pool's device ("cuda" on a GPU machine).
        rel_scale: tests: multiplies every count of the reliability suite.
        rel_seed: tests: the reliability suite's random seed.
    """

    cpu_bytes: int = 1 << 30
    disk_path: str | None = None
    disk_bytes: int = 8 << 30
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    namespace: str = ""
    write_through: bool = True
    disk_sync: bool = False
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
    load_policy: str = "auto"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    remote_password: str | None = field(default=None, repr=False, metadata=_ENV)
    results: str = field(default="results", metadata=_ENV)
    require_redis: bool = field(default=False, metadata=_ENV)
    require_vllm: bool = field(default=False, metadata=_ENV)
    require_dynamo: bool = field(default=False, metadata=_ENV)
    test_pool_device: str = field(default="cpu", metadata=_ENV)
    rel_scale: float = field(default=1.0, metadata=_ENV)
    rel_seed: int = field(default=7, metadata=_ENV)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cpu_bytes", parse_bytes("cpu_bytes", self.cpu_bytes))
        set_(self, "disk_bytes", parse_bytes("disk_bytes", self.disk_bytes))
        set_(self, "hash_algo", parse_hash_algo(self.hash_algo))
        for name in ("disk_codec", "remote_codec"):
            set_(self, name, parse_codec(getattr(self, name), name))
        for name in ("write_through", "disk_sync", "verify_tokens", "async_saves", "async_loads", "require_redis",
                     "require_vllm", "require_dynamo", "events_insecure", "events_connect"):
            set_(self, name, parse_bool(name, getattr(self, name)))
        for name in ("disk_path", "stats_path"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                    raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
                set_(self, name, os.fspath(value))
        for name in ("namespace", "results", "test_pool_device"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.remote_url is not None and not isinstance(self.remote_url, str):
            raise ConfigError(f"remote_url must be a URL string, got {self.remote_url!r}")
        if self.events_endpoint is not None:
            check_events(self.events_endpoint, self.events_replay_endpoint, self.events_topic,
                         self.events_curve_cert, self.events_curve_clients, self.events_insecure,
                         connect=self.events_connect)
        if self.instance_id is not None and (not isinstance(self.instance_id, str) or not self.instance_id):
            raise ConfigError(f"instance_id must be a non-empty str, got {self.instance_id!r}")
        set_(self, "metrics_port", _optional_int("metrics_port", self.metrics_port, 1, 65535))
        host = self.metrics_host
        if not isinstance(host, str) or not host or any(c.isspace() for c in host):
            raise ConfigError(f"metrics_host must be a host name or address, got {self.metrics_host!r}")
        from kvstore.load_policy import check_mode

        check_mode(self.load_policy)
        try:
            set_(self, "rel_scale", float(self.rel_scale))
        except (TypeError, ValueError):
            set_(self, "rel_scale", -1.0)
        if not self.rel_scale > 0:
            raise ConfigError(f"rel_scale must be a number > 0, got {self.rel_scale!r}")
        set_(self, "rel_seed", _optional_int("rel_seed", self.rel_seed, 0, 2**32 - 1))
        if self.cpu_bytes == 0 and self.disk_path is None and self.remote_url is None:
            raise ConfigError("the connector enables no tier: set cpu_bytes > 0, disk_path or remote_url")

    @classmethod
    def keys(cls) -> list[str]:
        """Names accepted as connector keys."""
        return [f.name for f in fields(cls) if not f.metadata.get("env_only")]

    @classmethod
    def variables(cls) -> list[str]:
        """Every `KVSTRATA_*` variable read."""
        return [ENV_PREFIX + f.name.upper() for f in fields(cls)]

    @classmethod
    def from_sources(
        cls, extra_config: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Merge `extra_config` over the `KVSTRATA_*` variables of `environ` (default
        `os.environ`) over the defaults. Raises `ConfigError` naming an unknown key or
        variable, or a bad value."""
        environ = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(cls.keys()))
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {cls.keys()}")
        strange = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in cls.variables())
        if strange:
            raise ConfigError(f"unknown environment variables {strange}; kvstrata reads: {cls.variables()}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = environ.get(ENV_PREFIX + f.name.upper())
            if f.name in extra:
                values[f.name] = extra[f.name]
            elif env is not None and env != "":
                values[f.name] = env
        return cls(**values)

    @classmethod
    def table(cls) -> str:
        """The Markdown table of every setting (docs/configuration.md)."""
        doc = cls.__doc__ or ""
        described: dict[str, str] = {}
        for match in re.finditer(r"^\s{8}(\w+): (.*?)(?=^\s{8}\w+: |^\s*Attributes|\Z)", doc, re.M | re.S):
            described[match.group(1)] = " ".join(match.group(2).split())
        rows = ["| setting | connector key | environment variable | default | what it does |",
                "| --- | --- | --- | --- | --- |"]
        for f in fields(cls):
            key = "-" if f.metadata.get("env_only") else f"`{f.name}`"
            default = f.default.value if isinstance(f.default, HashAlgo) else f.default
            default = default.label if isinstance(default, CodecKind) else default
            rows.append(f"| {f.name} | {key} | `{ENV_PREFIX}{f.name.upper()}` | `{default!r}` | "
                        f"{described.get(f.name, '')} |")
        return "\n".join(rows) + "\n"
