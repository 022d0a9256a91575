"""Decoding KV-event messages defensively: every malformed message or event is a
`BadMessage` (the caller counts and logs it and carries on), never an exception of another
kind, and nothing decoded can hold more than the message's own bytes allow.

Accepted: vLLM's batches `[ts, events, dp_rank?]` with events as tagged maps (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`; other tags are ignored), block hashes as 64-bit ints
(signed or unsigned) or bytes (their last 8, as vLLM converts them), and kvstrata's extra
"kvstrata" map. The payload is unpacked by `kvevents.unpack_peer`: what it builds
is bounded by the payload's size, whatever lengths or nesting it declares. No value a peer
sent is ever printed (a deeply nested one would exhaust the interpreter's recursion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvevents import BadPayload, unpack_peer

MAX_BLOCK_SIZE = 1 << 16
_MASK = (1 << 64) - 1


class BadMessage(BadPayload):
    """A message or event that cannot be used; the message says why."""


@dataclass(frozen=True)
class Meta:
    """kvstrata's extras of an event (all optional)."""

    instance: str | None = None
    model: str | None = None
    epoch: int | None = None
    remote: str | None = None
    namespace: str | None = None
    media: tuple[str, ...] | None = None  # on AllBlocksCleared: the media it clears
    block_size: int | None = None


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    tokens: np.ndarray  # uint32, len(hashes) * block_size
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None  # per block: a list of items, or None
    meta: Meta | None


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str | None
    meta: Meta | None


@dataclass(frozen=True)
class Cleared:
    meta: Meta | None


Event = Stored | Removed | Cleared


def _text(value: object, what: str, limit: int = 1024) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise BadMessage(f"{what} is not a string of at most {limit} characters")
    return value


def _hash(value: object) -> int:
    if isinstance(value, bool):
        raise BadMessage("a block hash is a bool")
    if isinstance(value, int) and -(1 << 63) <= value <= _MASK:
        return value & _MASK
    if isinstance(value, bytes) and 0 < len(value) <= 64:
        return int.from_bytes(value[-8:], "big")
    raise BadMessage(f"a block hash is neither a 64-bit int nor bytes: {type(value).__name__}")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise BadMessage("block_hashes is not a list")
    return tuple(_hash(h) for h in value)


def _meta(value: object) -> Meta | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadMessage("the kvstrata map is not a map")
    epoch = value.get("epoch")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise BadMessage(f"epoch is not an int: a {type(epoch).__name__}")
    media = value.get("media")
    if media is not None:
        if not isinstance(media, list) or len(media) > 16:
            raise BadMessage("media is not a short list")
        media = tuple(_text(m, "a medium", 32) or "" for m in media)
    size = value.get("block_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE):
        raise BadMessage(f"block_size is not an int in [1, {MAX_BLOCK_SIZE}]: a {type(size).__name__}")
    return Meta(_text(value.get("instance"), "instance", 256), _text(value.get("model"), "model", 256), epoch,
                _text(value.get("remote"), "remote", 1024), _text(value.get("ns"), "ns", 64), media, size)


def _stored(event: dict[Any, Any], meta: Meta | None) -> Stored:
    hashes = _hashes(event.get("block_hashes"))
    parent = event.get("parent_block_hash")
    size = event.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
        raise BadMessage(f"block_size is not an int in [1, {MAX_BLOCK_SIZE}]: a {type(size).__name__}")
    tokens = event.get("token_ids")
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
        raise BadMessage(f"token_ids is not a list of {len(hashes)} x {size} tokens")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32 for t in tokens):
        raise BadMessage("token_ids holds something other than ints in [0, 2**32)")
    extra = event.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)
                              or not all(e is None or isinstance(e, list) for e in extra)):
        raise BadMessage("extra_keys is not a list of one entry per block")
    return Stored(hashes, None if parent is None else _hash(parent), np.asarray(tokens, dtype="<u4"), size,
                  _text(event.get("medium"), "medium", 32), _text(event.get("lora_name"), "lora_name"),
                  None if extra is None else tuple(extra), meta)


def decode_event(event: object) -> Event | None:
    """One event; None for a tag this reader ignores. Raises `BadMessage`."""
    if not isinstance(event, dict):
        raise BadMessage(f"an event is a {type(event).__name__}, not a map")
    kind = event.get("type")
    meta = _meta(event.get("kvstrata"))
    if kind == "BlockStored":
        return _stored(event, meta)
    if kind == "BlockRemoved":
        return Removed(_hashes(event.get("block_hashes")), _text(event.get("medium"), "medium", 32), meta)
    if kind == "AllBlocksCleared":
        return Cleared(meta)
    if isinstance(kind, str):
        return None
    raise BadMessage("an event has no type")


def decode_batch(payload: bytes) -> tuple[list[Event], int]:
    """The events of one message payload and how many of them were malformed (left out).
    Raises `BadMessage` if the payload is not a batch at all."""
    try:
        batch = unpack_peer(payload)
    except BadPayload as exc:
        raise BadMessage(str(exc)) from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3 or not isinstance(batch[1], list):
        raise BadMessage("not a [ts, events, dp_rank] array")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise BadMessage("the timestamp is not a finite number")
    events: list[Event] = []
    bad = 0
    for raw in batch[1]:
        try:
            event = decode_event(raw)
        except BadMessage:
            bad += 1
            continue
        if event is not None:
            events.append(event)
    return events, bad
