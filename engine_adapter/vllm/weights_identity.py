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
    return _digests([(str(p.relative_to(root)), p) for p in files])


_MEMORY: dict[str, str] = {}  # file digests by stat key, this process's (a key changes with every write)


def _digests(named: list[tuple[str, str | os.PathLike[str]]]) -> list[list[str]]:
    """`[[name, digest], ...]` of the files `(name, path)`: from this process's cache (loaded
    once from the file all processes share), the new ones hashed and written back."""
    with _LOCK:
        if not _MEMORY:
            _MEMORY.update(_load_cache())
        before = len(_MEMORY)
        out = [[name, file_digest(path, _MEMORY)] for name, path in named]
        if len(_MEMORY) != before:
            _save_cache({**_load_cache(), **_MEMORY})
    return out


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


def adapter_dir(path: str) -> str | None:
    """The local directory vLLM loads a LoRA adapter from (`vllm.lora.utils`'s resolution: an
    absolute path, `~` expanded, or a relative one that exists); None for a hub or ModelScope
    id, which vLLM downloads at the latest revision (not identifiable here before it does)."""
    if path.startswith("~"):
        path = os.path.expanduser(path)
    if not os.path.isabs(path):
        if not os.path.exists(path):
            return None
        path = os.path.abspath(path)
    return path if os.path.isdir(path) else None


def adapter_identity(path: str) -> str | None:
    """A LoRA adapter's content digest: xxh3-128 over the digests of the files vLLM reads
    (`ADAPTER_FILES` at the top of its directory: a trainer's other files and checkpoint
    folders beside them are not read, so not hashed); None if it is not a local directory or
    lacks its config or weights. A stat per file once digested (cached by stat key)."""
    root = adapter_dir(path)
    if root is None:
        return None
    files = [name for name in ADAPTER_FILES if os.path.isfile(os.path.join(root, name))]
    if ADAPTER_FILES[0] not in files or len(files) < 2:
        return None
    try:
        digests = _digests([(name, os.path.join(root, name)) for name in files])
    except OSError:  # removed or unreadable meanwhile: not identified
        return None
    return xxhash.xxh3_128_hexdigest(json.dumps(digests).encode())


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
