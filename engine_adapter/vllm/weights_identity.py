"""Content-derived identity of a checkpoint: the same bytes give the same identity on every host.

The connector's namespace must name the weights a KV cache was computed with, on this host
and on any other that shares the disk or remote tier. File names, sizes and mtimes do not:
a copied checkpoint gets new mtimes, and a rewritten one can keep its old mtime. This module
hashes the bytes (xxh3-128) of every weight and config file in a checkpoint directory. The
digests are cached per file under a key of (device, inode, size, mtime, ctime): ctime
changes on every write and cannot be set back by a user, so a rewritten file is hashed again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from pathlib import Path

import xxhash

from kvstore.errors import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_SUFFIXES = (".json", ".model", ".txt", ".py")  # configs, quantization configs, remote code
_CHUNK = 16 << 20
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_LOCK = threading.Lock()


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstrata" / "file-digests.json"


def _load_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict[str, str]) -> None:
    path = _cache_path()
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, sort_keys=True))
        os.replace(tmp, path)


def file_digest(path: str | os.PathLike[str], cache: dict[str, str] | None = None) -> str:
    """xxh3-128 hex digest of a file's bytes (looked up in `cache` by its stat key)."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    if cache is not None and key in cache:
        return cache[key]
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[key] = digest
    return digest


def checkpoint_identity(directory: str | os.PathLike[str]) -> list[list[str]]:
    """`[[relative name, digest], ...]` of a checkpoint directory's weight and config files.

    Raises `ConfigError` if it holds no weight file (nothing would identify the weights).
    """
    root = Path(directory)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES + CONFIG_SUFFIXES))
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ConfigError(f"checkpoint {str(root)!r} holds no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    with _LOCK:
        if not _MEMORY:  # (this process's digests, over the file other processes share)
            _MEMORY.update(_load_cache())
        before = len(_MEMORY)
        out = [[str(p.relative_to(root)), file_digest(p, _MEMORY)] for p in files]
        if len(_MEMORY) != before:
            _save_cache({**_load_cache(), **_MEMORY})
    return out


_MEMORY: dict[str, str] = {}  # file digests by stat key, this process's (a key changes with every write)


def adapter_identity(path: str) -> str | None:
    """A LoRA adapter's content digest (xxh3-128 over its files' digests, as
    `checkpoint_identity`): a local directory's, else a hub adapter's cached snapshot's; None
    if neither holds a weight file. Costs a directory walk and a stat per file once digested
    (per request: a rewritten adapter, same name and path, gets a new identity at once)."""
    root = path if os.path.isdir(path) else hub_snapshot(path, None)
    if root is None:
        return None
    try:
        files = checkpoint_identity(root)
    except (ConfigError, OSError):  # no weight file, or unreadable: not identified
        return None
    return xxhash.xxh3_128_hexdigest(json.dumps(files).encode())


def hub_snapshot(model: str, revision: str | None) -> str | None:
    """The local snapshot directory of a hub model at `revision`, from the local cache only."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return str(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, not a repo name, offline: no snapshot to identify
        return None


def weights_identity(model: str, revision: str | None) -> list[object]:
    """What identifies the weights vLLM loads for `model`: a local directory's content
    digests; a hub model's cached snapshot's digests; else a pinned 40-hex commit.

    Raises `ConfigError` when none of these is available (an unpinned hub name whose files
    are not in the local cache): the KV could not be told apart from another revision's.
    """
    if os.path.isdir(model):
        return ["local", checkpoint_identity(model)]
    snapshot = hub_snapshot(model, revision)
    if snapshot is not None:
        return ["hub", model, checkpoint_identity(snapshot)]
    if revision is not None and _COMMIT.match(revision):
        return ["hub", model, revision]
    raise ConfigError(
        f"kvstrata cannot identify the weights of model {model!r} (revision {revision!r}): it is not a local "
        "directory, not in the local Hugging Face cache, and not pinned to a 40-hex commit. Pin the revision "
        "or point vLLM at a local checkpoint."
    )
