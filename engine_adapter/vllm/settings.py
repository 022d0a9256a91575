"""The vLLM connector's settings: `kv_connector_extra_config` first, `KVSTRATA_*` env second.

This is the one place the connector reads its configuration. Every key of
`kv_connector_extra_config` has an environment variable named `KVSTRATA_<KEY upper-case>`;
a key given in the extra config wins over the variable, which wins over the default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvstore.config import HashAlgo, parse_hash_algo
from kvstore.errors import ConfigError
from kvstore.events import check_endpoint

ENV_PREFIX = "KVSTRATA_"
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def parse_bytes(name: str, value: object) -> int:
    """An int, or a string like "512MiB", "4G", "1048576" (K/M/G/T are powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " ")
    raise ConfigError(f"{name} must be a byte count such as 1073741824 or '1GiB', got {value!r}")


def parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{name} must be a bool (true/false/1/0), got {value!r}")


@dataclass(frozen=True)
class ConnectorSettings:
    """How `TierKVConnector` sets up its `KVCacheStore`.

    Attributes:
        cpu_bytes: CPU-tier capacity in the worker (0 disables it).
        disk_path: LMDB directory; shared by every engine and process that names it. Needed
            when the scheduler and the worker run in different processes (vLLM's default
            multiprocess mode): the scheduler then sees what the worker stored through it.
        disk_bytes: disk-tier capacity.
        hash_algo: `xxh3_128` (default) or `sha256`.
        namespace: extra text mixed into every key (e.g. a checkpoint revision the model
            path does not show).
        write_through: write each saved block to disk at once (survives a killed engine and
            is visible to other processes at once). Otherwise blocks reach disk on CPU-tier
            eviction or shutdown.
        disk_sync: fsync every LMDB commit (only matters for power loss).
        verify_tokens: keep token ids beside each block; a hit whose tokens differ is a miss.
        stats_path: if set, the worker keeps a JSON file of its load/save counters here.
        remote_url: a Valkey/Redis server (or cluster, `redis+cluster://...`) shared by engines
            on many hosts (`KVSTRATA_REMOTE_URL`); the namespace is content-derived, so hosts
            that load the same weights share keys.
        events_endpoint: publish the worker's KV events here (`tcp://HOST:PORT`, the next port
            answers snapshots) for `kvstrata router` (docs/routing.md).
        instance_id: this engine's name in its KV events (default `HOST:PID`).
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
    remote_url: str | None = None
    events_endpoint: str | None = None
    instance_id: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cpu_bytes", parse_bytes("cpu_bytes", self.cpu_bytes))
        set_(self, "disk_bytes", parse_bytes("disk_bytes", self.disk_bytes))
        set_(self, "hash_algo", parse_hash_algo(self.hash_algo))
        for name in ("write_through", "disk_sync", "verify_tokens"):
            set_(self, name, parse_bool(name, getattr(self, name)))
        for name in ("disk_path", "stats_path"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                    raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
                set_(self, name, os.fspath(value))
        if not isinstance(self.namespace, str):
            raise ConfigError(f"namespace must be a str, got {self.namespace!r}")
        if self.events_endpoint is not None:
            check_endpoint(self.events_endpoint)
        if self.instance_id is not None and (not isinstance(self.instance_id, str) or not self.instance_id):
            raise ConfigError(f"instance_id must be a non-empty str, got {self.instance_id!r}")
        if self.remote_url is not None and not isinstance(self.remote_url, str):
            raise ConfigError(f"remote_url must be a URL string, got {self.remote_url!r}")
        if self.cpu_bytes == 0 and self.disk_path is None and self.remote_url is None:
            raise ConfigError("the connector enables no tier: set cpu_bytes > 0, disk_path or remote_url")

    @classmethod
    def from_sources(
        cls, extra_config: Mapping[str, object] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Merge `extra_config` over `KVSTRATA_*` variables of `environ` (default os.environ).

        Raises `ConfigError` naming an unknown key or a bad value.
        """
        environ = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        values: dict[str, object] = {}
        for name in known:
            env = environ.get(ENV_PREFIX + name.upper())
            if name in extra:
                values[name] = extra[name]
            elif env is not None and env != "":
                values[name] = env
        return cls(**values)  # type: ignore[arg-type]  # raw strings: __post_init__ parses each
