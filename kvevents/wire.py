"""The KV-event wire format: vLLM's (`vllm/distributed/kv_events.py`), which Dynamo's KV
router and indexer, llm-d's KV-cache indexer and `kvstrata router` all read.

A message is three ZeroMQ frames, `[topic, seq, payload]`: `seq` is an 8-byte big-endian
batch number (vLLM counts from 0 per publisher lifetime; kvstrata from its start time in
microseconds, so a restart's numbers continue above the last lifetime's), `payload` the
msgpack array `[ts, events, dp_rank]`. Events are maps tagged by "type":

- `BlockStored`: `block_hashes` (64-bit ints), `parent_block_hash` (the block before the
  first one, None for a sequence's first block), `token_ids` (every token of the blocks),
  `block_size`, `lora_id` (None), `medium`, `lora_name`, and `extra_keys` (per block, what
  besides the tokens entered its hash, in vLLM's order: LoRA name, multimodal pairs, cache
  salt; omitted when no block has any);
- `BlockRemoved`: `block_hashes`, `medium`;
- `AllBlocksCleared`.

Media: the pool is "GPU", the CPU tier "CPU", the disk "DISK", the shared remote tier
"SHARED" (Dynamo's external tier). kvstrata's own facts ride under the extra key
"kvstrata", which other readers ignore: the instance label, model label, publisher epoch,
the remote tier's redacted identity, a fingerprint of the namespace (never the seed), the
block size,
and on `AllBlocksCleared` the media it clears (none named: all of them).

Replay (vLLM's protocol): a DEALER sends `[b"", start_seq]` to the ROUTER on the replay
endpoint and receives `[b"", seq, payload]` for each batch from `start_seq` on, then
`[b"", END_SEQ, b""]`.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgpack
import numpy as np

from tiers.base import TierTraits
from tiers.errors import ConfigError, InvalidInputError
from tiers.keys import BlockKey

DEFAULT_PORT = 5590  # vLLM's own default is 5557: both can run on one host
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIA = ("GPU", "CPU", "DISK", "SHARED")  # vLLM's names; SHARED is what Dynamo maps to its external tier
SHARED = "SHARED"
KVSTRATA = "kvstrata"
MAX_MESSAGE_BYTES = 16 << 20  # zmq.MAXMSGSIZE of every receiving socket
MAX_BATCH_TOKENS = 1 << 16  # a batch is cut into messages of at most this many tokens


class BadPayload(InvalidInputError):
    """Bytes from a peer that are not what they should be; the message says why."""


def unpack_peer(payload: bytes) -> Any:
    """The msgpack object of bytes from a peer, built only once they are known to hold it
    whole: msgpack reserves room for every array or map as its header declares, so the
    bytes are first skipped through (nothing is built; past 1024 levels of nesting it
    stops) and must end exactly where the object does. Every element then stands on a
    byte of its own and no length can exceed the payload's: what is built is bounded by
    `len(payload)`, whatever the lengths declared or the nesting. `BadPayload` otherwise."""
    n = len(payload)
    limits = {"max_str_len": n, "max_bin_len": n, "max_array_len": n, "max_map_len": n // 2, "max_ext_len": 0}
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(n, 1), **limits)
        unpacker.feed(payload)
        unpacker.skip()
        if unpacker.tell() != n:
            raise BadPayload(f"{n - unpacker.tell()} bytes after the msgpack object")
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, **limits)
    except BadPayload:
        raise
    except Exception as exc:  # msgpack raises many types on garbage, truncation and deep nesting
        raise BadPayload(f"not one whole msgpack object: {type(exc).__name__}") from None


def medium_of(traits: TierTraits) -> str:
    """The medium a tier's blocks are announced in, from what the tier is: GPU (the engine's
    own paged blocks), SHARED (a tier other hosts read), CPU (memory), DISK (the rest)."""
    if traits.engine_memory:
        return "GPU"
    if traits.shared:
        return SHARED
    return "CPU" if traits.memory else "DISK"


def check_endpoint(endpoint: object, name: str = "events_endpoint") -> str:
    """`endpoint` if it is `tcp://HOST:PORT` (PORT in 1..65534) or `ipc://PATH`, else a
    `ConfigError` naming it."""
    if isinstance(endpoint, str):
        if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
            return endpoint
        if endpoint.startswith("tcp://"):
            try:
                parts = urlsplit(endpoint)
                port = parts.port
            except ValueError:
                port = None
            if parts.hostname and port is not None and 0 < port < 65535:
                return endpoint
    raise ConfigError(f"{name} must be 'tcp://HOST:PORT' or 'ipc://PATH', got {endpoint!r}")


def is_local(endpoint: str) -> bool:
    """Whether only this host can reach `endpoint`: ipc, or tcp on a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard ("*"): reachable from elsewhere


def check_events(endpoint: object, replay: object, topic: object, curve_cert: object, curve_clients: object,
                 insecure: object, owner: str = "", connect: object = False) -> None:
    """Validate the `events_*` settings together; `ConfigError` naming the bad one."""
    check_endpoint(endpoint, f"{owner}events_endpoint")
    assert isinstance(endpoint, str)
    if replay is not None:
        check_endpoint(replay, f"{owner}events_replay_endpoint")
    if not isinstance(topic, str) or len(topic) > 256:
        raise ConfigError(f"{owner}events_topic must be a str of at most 256 characters, got {topic!r}")
    for name, value in (("events_curve_cert", curve_cert), ("events_curve_clients", curve_clients)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{owner}{name} must be a path, got {value!r}")
    if (curve_cert is None) != (curve_clients is None):
        raise ConfigError(f"{owner}events_curve_cert and {owner}events_curve_clients go together (got only one)")
    if not isinstance(insecure, bool) or not isinstance(connect, bool):
        raise ConfigError(f"{owner}events_insecure and {owner}events_connect must be bools, got "
                          f"{insecure!r}, {connect!r}")
    if connect and curve_cert is not None:
        raise ConfigError(f"{owner}events_curve_cert authenticates the readers of a bound endpoint; with "
                          f"{owner}events_connect the reader binds (CURVE is not supported there)")
    reachable = (not connect and not is_local(endpoint)) or (isinstance(replay, str) and not is_local(replay))
    if reachable and curve_cert is None and not insecure:
        raise ConfigError(
            f"{owner}events_endpoint {endpoint!r} can be reached from other hosts, and KV events show every "
            f"cached block's token ids: give {owner}events_curve_cert and {owner}events_curve_clients "
            f"(docs/security.md), or set {owner}events_insecure=True for readers without CURVE (Dynamo, llm-d)")


def default_replay_endpoint(endpoint: str) -> str:
    """The replay endpoint beside `endpoint`: the next TCP port, or `<path>.replay`."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    parts = urlsplit(endpoint)
    assert parts.port is not None
    host = parts.netloc.rsplit(":", 1)[0]
    return f"tcp://{host}:{parts.port + 1}"


def wire_hash(digest: bytes) -> int:
    """A block digest on the wire: its first 8 bytes as an unsigned big-endian int."""
    return int.from_bytes(digest[:8], "big")


def token_list(tokens: bytes) -> list[int]:
    """Token ids of a key's little-endian uint32 bytes."""
    return np.frombuffer(tokens, dtype="<u4").tolist()  # type: ignore[no-any-return]


def vllm_extras(extras: bytes) -> tuple[str | None, list[Any] | None]:
    """(LoRA name, vLLM `extra_keys` entry) of one block from its canonical extras
    (`kvstore.hashing.ExtraKeys.block_extras`; read back from a disk, they may be damaged:
    `BadPayload` then)."""
    if not extras:
        return None, None
    lora: str | None = None
    mm: list[Any] = []
    salt: list[Any] = []
    items = unpack_peer(bytes(extras))
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) in (2, 3) for i in items):
        raise BadPayload("block extras are not a list of [kind, value] items")
    for item in items:
        if item[0] == "lora":
            lora = str(item[1])
        elif item[0] == "mm":
            mm.append([item[1], item[2]])
        elif item[0] == "salt":
            salt.append(item[1])
    entry = ([lora] if lora is not None else []) + mm + salt
    return lora, entry or None


def stored_events(items: Iterable[tuple[BlockKey, str]], seed: bytes, block_size: int,
                  meta: dict[str, Any]) -> list[dict[str, Any]]:
    """`BlockStored` events of fully described keys, each with its medium, given parents
    before children: per medium, one event per run of keys each extending the one before
    under one LoRA name. Every block's parent comes before it in the events' order."""
    events: list[dict[str, Any]] = []
    runs: dict[str, tuple[dict[str, Any], bytes]] = {}  # medium -> (open event, its last hash)
    for key, medium in items:
        assert key.parent is not None and key.extras is not None
        lora, extra = vllm_extras(key.extras)
        open_run = runs.get(medium)
        if open_run is not None and open_run[1] == key.parent and open_run[0]["lora_name"] == lora:
            run = open_run[0]
        else:
            parent = None if key.parent == seed else wire_hash(key.parent)
            run = {"type": "BlockStored", "block_hashes": [], "parent_block_hash": parent, "token_ids": [],
                   "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora,
                   "extra_keys": [], KVSTRATA: meta}
            events.append(run)
        run["block_hashes"].append(wire_hash(key.block_hash))
        run["token_ids"].extend(token_list(key.tokens))
        run["extra_keys"].append(extra)
        runs[medium] = (run, bytes(key.block_hash))
    for event in events:
        if not any(event["extra_keys"]):
            del event["extra_keys"]
    return events


def removed_event(hashes: Iterable[bytes], medium: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [wire_hash(h) for h in hashes], "medium": medium, KVSTRATA: meta}


def cleared_event(media: Sequence[str] | None, meta: dict[str, Any]) -> dict[str, Any]:
    """`AllBlocksCleared`; `media` (kvstrata's extra) limits it to those media."""
    return {"type": "AllBlocksCleared", KVSTRATA: {**meta, "media": list(media) if media is not None else None}}


def event_tokens(event: dict[str, Any]) -> int:
    """A rough size of an event, in tokens or hashes, for cutting batches."""
    return len(event.get("token_ids") or ()) + len(event.get("block_hashes") or ()) + 1


def encode_batch(events: list[dict[str, Any]], dp_rank: int = 0) -> bytes:
    """The payload of one message: `[ts, events, dp_rank]`."""
    return msgpack.packb([time.time(), events, dp_rank], use_bin_type=True)  # type: ignore[no-any-return]


def cut(events: list[dict[str, Any]], max_tokens: int = MAX_BATCH_TOKENS) -> list[list[dict[str, Any]]]:
    """`events` in consecutive groups of at most about `max_tokens` tokens each (an event
    larger than that is a group of its own); [] for none."""
    groups: list[list[dict[str, Any]]] = []
    size = max_tokens
    for event in events:
        n = event_tokens(event)
        if size + n > max_tokens:
            groups.append([])
            size = 0
        groups[-1].append(event)
        size += n
    return groups
