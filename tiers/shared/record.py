"""A self-checking block record: encoding, validation and the payload copy-out.

The tiers other hosts share store their values in this form: the servers' (`remote`,
`mooncake`) as values, the shared-filesystem tier's as files (it began as the first disk
format's record; the disk tier now keeps payloads in slot files and their checks in its index,
`tiers/disk/`).

Record (format 2) = b"KVS2" | u32 header length | u64 xxh3-64 | msgpack header | payload.
The checksum covers every byte but its own: the magic, the header length, the header as
stored and the payload as stored (encoded), so a flipped bit anywhere, in a field that
decoding depends on as much as in the payload, is a `CorruptRecordError`. The header names
the format version, the key, the namespace of the store that wrote it, the layout (dtype,
shape), the payload's codec ("c", `tiers/codecs`; 0: raw bytes) and for an encoded payload
what its decoding depends on beyond the layout (the element dtype "el" and, for a lossy
codec, the group "g"), the payload's length, the block's token ids, and optionally its
parent's hash ("par") and extra keys ("ext"). Any mismatch with the key or the reader's
namespace and layout is a `CorruptRecordError`, and so is an encoded payload that does not
decode. A record this reader can check but not decode is an `UnverifiableRecordError` (a
miss, left in place): a codec it does not know, cannot load (its library missing) or does
not accept (a lossy one for a reader that wants exact KV), a payload encoded with another
element dtype or group, or a record of format 1 (b"KVS1", whose checksum left the codec,
layout and version out: never decoded).
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgpack
import numpy as np
import torch
import xxhash

from tiers.codecs import Codec, CodecKind, CodecSpec
from tiers.codecs.records import LayoutCodecs, check_tokens
from tiers.errors import CorruptRecordError, UnverifiableRecordError
from tiers.keys import BlockKey
from tiers.shared.blockcopy import copy_block

FORMAT_VERSION = 2
_MAGIC = b"KVS2"
_OLD_MAGIC = b"KVS1"  # format 1: its checksum covered key, namespace, tokens and payload only
_PREFIX = struct.Struct("<4sIQ")  # magic, header length, checksum
_COVERED = 8  # the prefix's bytes before the checksum (covered by it)
MAX_RUNS = 1024  # a block received in place in at most this many runs (`RecordCodec.landing`)
MIN_RUN_BYTES = 32 << 10  # ... each of at least this many bytes (shorter: a receive and a copy cost less)


class Payload(NamedTuple):
    """A validated record's payload as stored, and the codec id its header names."""

    data: memoryview
    codec_id: int


def _digest(head: memoryview | bytes, rest: Sequence[memoryview]) -> int:
    h = xxhash.xxh3_64(head)
    for part in rest:
        h.update(part)
    return h.intdigest()


def pack_record(header: dict[str, object], payload: memoryview | bytes | bytearray) -> bytearray:
    """A sealed record of `header` (msgpack-able fields) and `payload` (copied): the checksum
    computed over both. `RecordCodec.encode` builds its records the same way, in place."""
    packed = msgpack.packb(header, use_bin_type=True)
    buf = bytearray(_PREFIX.size + len(packed) + len(payload))
    buf[_PREFIX.size : _PREFIX.size + len(packed)] = packed
    buf[_PREFIX.size + len(packed) :] = payload
    _seal(buf, len(packed))
    return buf


def _seal(buf: bytearray | memoryview, hlen: int) -> None:
    """Write the prefix of the record in `buf` (header and payload already in place)."""
    _PREFIX.pack_into(buf, 0, _MAGIC, hlen, 0)
    mv = memoryview(buf)
    _PREFIX.pack_into(buf, 0, _MAGIC, hlen, _digest(mv[:_COVERED], (mv[_PREFIX.size :],)))


def _parse(mv: memoryview, block_hash: bytes, tail: Sequence[memoryview]) -> tuple[dict[str, object], int]:
    """The header (and its length) of the record `mv` then `tail` (the payload's views, or
    none: the payload is the rest of `mv`), checked as `parse_record` says; with `tail`, `mv`
    must end where the header does."""
    if len(mv) < _PREFIX.size:
        raise CorruptRecordError("record shorter than its prefix")
    magic, hlen, xxh = _PREFIX.unpack(mv[: _PREFIX.size])
    if magic == _OLD_MAGIC:
        raise UnverifiableRecordError("a record of format 1 (its checksum does not cover its header), not read")
    if magic != _MAGIC or _PREFIX.size + hlen > len(mv) or (tail and _PREFIX.size + hlen != len(mv)):
        raise CorruptRecordError("bad magic or header length")
    if _digest(mv[:_COVERED], (mv[_PREFIX.size :], *tail)) != xxh:
        raise CorruptRecordError("checksum mismatch")
    payload_bytes = len(mv) - _PREFIX.size - hlen + sum(part.nbytes for part in tail)
    return _header(mv, hlen, block_hash, payload_bytes), hlen


def _header(mv: memoryview, hlen: int, block_hash: bytes, payload_bytes: int) -> dict[str, object]:
    """The header of the record at the front of `mv` (its checksum held), checked against the
    key and the payload's length; see `parse_record`."""
    try:
        hdr = msgpack.unpackb(mv[_PREFIX.size : _PREFIX.size + hlen], raw=False)
    except Exception as exc:  # msgpack raises many types on garbage (a writer's bug: the checksum held)
        raise CorruptRecordError(f"undecodable header: {exc}") from None
    if not isinstance(hdr, dict) or hdr.get("v") != FORMAT_VERSION:
        raise CorruptRecordError("unknown record format")
    if hdr.get("key") != bytes(block_hash):
        raise CorruptRecordError("record stored under another key")
    if hdr.get("n") != payload_bytes:
        raise CorruptRecordError("payload length mismatch")
    if not all(isinstance(hdr.get(f, b""), bytes) for f in ("tok", "ns", "par", "ext")) or "tok" not in hdr:
        raise CorruptRecordError("bad token, namespace, parent or extras field")
    codec_id = hdr.get("c")
    if not isinstance(codec_id, int) or isinstance(codec_id, bool) or codec_id < 0:
        raise CorruptRecordError(f"bad codec field {codec_id!r}")
    return hdr


def parse_record(value: memoryview | bytes, block_hash: bytes) -> tuple[dict[str, object], memoryview]:
    """A record's header and payload, checked for self-consistency only (magic, checksum,
    format version, key, payload length, field types); raise `CorruptRecordError` if damaged,
    `UnverifiableRecordError` for a record of format 1. Says nothing about whether it is
    this tier's."""
    mv = memoryview(value).cast("B")
    hdr, hlen = _parse(mv, block_hash, ())
    return hdr, mv[_PREFIX.size + hlen :]


def header_ends(head: memoryview) -> bool:
    """Whether `head` ends where the header of the record it begins does (what follows it
    is then the payload): its prefix names a header of exactly the rest of `head`."""
    mv = head.cast("B")
    return len(mv) >= _PREFIX.size and _PREFIX.size + _PREFIX.unpack(mv[: _PREFIX.size])[1] == len(mv)


def parse_head(head: memoryview, tail: Sequence[memoryview], block_hash: bytes) -> dict[str, object]:
    """`parse_record` of a record received in parts: `head` (its prefix and header, whole:
    `header_ends`), then its payload in the views `tail`, in order; the header."""
    return _parse(head.cast("B"), block_hash, tail)[0]


class RecordCodec:
    """Encodes and validates the records of one layout and namespace; `codec` says how
    payloads are encoded and which encodings are read (default: raw bytes written, every
    lossless encoding read)."""

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, *, verify_tokens: bool,
                 namespace: bytes, codec: CodecSpec | None = None) -> None:
        self._shape = list(block_shape)
        self._dtype = dtype
        self._dtype_name = str(dtype).removeprefix("torch.")
        self._block_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self._verify_tokens = verify_tokens
        self._namespace = bytes(namespace)
        self._codecs = LayoutCodecs(codec, tuple(block_shape), dtype)
        self._spec = self._codecs.spec
        self._writer = None if self._spec.kind is CodecKind.NONE else self._codecs.get(self._spec.kind)

    @property
    def namespace(self) -> bytes:
        return self._namespace

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @staticmethod
    def _depends(codec: Codec) -> tuple[str, int | None]:
        """What decoding an encoded payload depends on beyond the layout: the element dtype,
        and for a lossy codec the group."""
        return str(codec.element_dtype).removeprefix("torch."), codec.group if codec.lossy else None

    def _header(self, key: BlockKey, codec: Codec | None, length: int) -> bytes:
        fields: dict[str, object] = {
            "v": FORMAT_VERSION, "key": bytes(key.block_hash), "ns": self._namespace, "dtype": self._dtype_name,
            "shape": self._shape, "c": 0 if codec is None else codec.kind.value, "n": length,
            "tok": key.tokens if self._verify_tokens else b""}
        if codec is not None:
            fields["el"], fields["g"] = self._depends(codec)
        if key.parent is not None and key.extras is not None:
            fields["par"], fields["ext"] = bytes(key.parent), bytes(key.extras)
        return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]  # untyped: bytes

    def encode(self, key: BlockKey, src: torch.Tensor) -> bytearray:
        """Build the record for one block: raw (one copy of the KV bytes), or encoded by this
        tier's codec. A block the codec cannot represent (infinite or NaN values for a lossy
        one) or does not make smaller (noise through a lossless one) is written raw."""
        made: list[bytearray] = []

        def alloc(size: int) -> memoryview:
            made.append(bytearray(size))
            return memoryview(made[0])

        self._build(key, src, alloc)
        return made[0]

    def encode_into(self, key: BlockKey, src: torch.Tensor, out: memoryview) -> int | None:
        """`encode` into the front of `out` (writable bytes, e.g. a registered transfer
        buffer), without a copy of its own; the record's length, or None (`out` left as it
        was) if it does not fit."""
        return self._build(key, src, lambda size: out[:size] if size <= len(out) else None)

    def _build(self, key: BlockKey, src: torch.Tensor,
               alloc: Callable[[int], memoryview | None]) -> int | None:
        encoded = None if self._writer is None else self._writer.encode(src)
        if encoded is not None and len(encoded) >= self._block_bytes:
            encoded = None
        length = self._block_bytes if encoded is None else len(encoded)
        header = self._header(key, None if encoded is None else self._writer, length)
        off = _PREFIX.size + len(header)
        buf = alloc(off + length)
        if buf is None:
            return None
        buf[_PREFIX.size : off] = header
        if encoded is None:
            payload = torch.frombuffer(buf, dtype=torch.uint8, offset=off, count=self._block_bytes)
            copy_block(payload.view(self._dtype).view(self._shape), src)
        else:
            buf[off:] = encoded
        _seal(buf, len(header))
        return off + length

    def encode_parts(self, key: BlockKey, src: torch.Tensor) -> tuple[bytearray, memoryview] | None:
        """A raw record of a contiguous CPU block without copying its payload: (its sealed
        prefix and header, the block's own bytes), written one after the other; None where
        `encode` must be used (a codec, another device, dtype, shape or strides). The
        checksum is taken now: a block changed before its bytes are written makes a record
        that fails its check (a miss), never a sound record of other bytes."""
        if self._writer is not None or src.device.type != "cpu" or src.dtype != self._dtype \
                or list(src.shape) != self._shape or not src.is_contiguous():
            return None
        payload = src.view(torch.uint8).numpy().reshape(-1).data
        header = self._header(key, None, self._block_bytes)
        head = bytearray(_PREFIX.size + len(header))
        head[_PREFIX.size :] = header
        _PREFIX.pack_into(head, 0, _MAGIC, len(header), 0)
        h = xxhash.xxh3_64(memoryview(head)[:_COVERED])
        h.update(memoryview(head)[_PREFIX.size :])
        h.update(payload)
        _PREFIX.pack_into(head, 0, _MAGIC, len(header), h.intdigest())
        return head, payload

    def landing(self, dst: torch.Tensor) -> list[memoryview] | None:
        """Where in block `dst` a raw payload's bytes may be received straight: the views of
        its contiguous runs, in the payload's order (one for a contiguous block; one per
        leading index where only its trailing dimensions are, as a block's rows of a
        `[layers, 2, tokens, heads, dim]` tensor: a layer's K or V), or None: `dst` is not a
        CPU tensor of this layout with disjoint runs, or they are more than `MAX_RUNS` or
        shorter than `MIN_RUN_BYTES` (a receive and a copy then cost less)."""
        if dst.device.type != "cpu" or dst.dtype != self._dtype or list(dst.shape) != self._shape \
                or dst.stride()[-1] != 1:
            return None
        u8 = dst.detach().view(torch.uint8)
        if u8.is_contiguous():  # one run (a staging buffer's or the pool's block)
            flat = u8.view(-1).numpy()
            return [flat.data] if flat.flags.writeable else None
        shape, strides = u8.shape, u8.stride()
        lead, run = len(shape), 1
        while lead and (shape[lead - 1] == 1 or strides[lead - 1] == run):
            lead -= 1
            run *= shape[lead]
        if math.prod(shape[:lead]) > MAX_RUNS or (lead and run < MIN_RUN_BYTES):
            return None
        offsets = [0]
        for n, stride in zip(shape[:lead], strides[:lead]):
            offsets = [o + i * stride for o in offsets for i in range(n)]
        ordered = sorted(offsets)
        if any(b - a < run for a, b in itertools.pairwise(ordered)):
            return None  # runs that overlap (a stride of 0)
        whole = torch.as_strided(u8, (ordered[-1] + run,), (1,)).numpy()
        if not whole.flags.writeable:
            return None
        return [whole.data[o : o + run] for o in offsets]

    def decode(self, value: memoryview | bytes, key: BlockKey) -> Payload:
        """Validate a record as this tier's block `key` and return its payload; raise
        `CorruptRecordError` if damaged, `UnverifiableRecordError` if it is sound but this
        reader cannot check or decode it (no token ids to check against `key.tokens`; a
        codec it does not know or accept, or an encoding of another element dtype or group;
        format 1). An encoded payload's bytes are checked by `copy_out`."""
        hdr, payload = parse_record(value, key.block_hash)
        return Payload(payload, self._check(hdr, key))

    def decode_landed(self, head: memoryview, tail: Sequence[memoryview], key: BlockKey) -> int:
        """`decode` of a record received as `head` (its prefix and header, whole) and then its
        payload in `tail` (`landing`'s views); its codec id (0: raw, the payload is in place)."""
        return self._check(parse_head(head, tail, key.block_hash), key)

    def _check(self, hdr: dict[str, object], key: BlockKey) -> int:
        """The codec id of a record whose header `hdr` is sound (its "n" the payload's length,
        as `parse_record` checked), once its namespace, layout, token ids and encoding are
        found this reader's (see `decode`)."""
        if hdr.get("ns") != self._namespace:
            raise CorruptRecordError("record of another namespace under this key")
        codec_id = hdr["c"]
        assert isinstance(codec_id, int)  # `parse_record` checked it
        if hdr.get("dtype") != self._dtype_name or hdr.get("shape") != self._shape or (
                codec_id == 0 and hdr["n"] != self._block_bytes):
            raise CorruptRecordError("record layout differs from this tier's")
        tokens = hdr["tok"]
        assert isinstance(tokens, bytes)  # `parse_record` checked it
        check_tokens(self._verify_tokens, key.tokens, tokens, "record")
        if codec_id:
            codec = self._codecs.reader(codec_id, "record")
            if (hdr.get("el"), hdr.get("g")) != self._depends(codec):
                raise UnverifiableRecordError(f"{codec.kind.label} record encoded with another element dtype or group")
        return codec_id

    def copy_out(self, payload: Payload, dst: torch.Tensor) -> None:
        """Write a `decode`d payload into `dst`. Raises `CorruptRecordError` if an encoded
        payload does not decode (`dst` may then hold part of the block)."""
        if payload.codec_id:
            self._codecs.reader(payload.codec_id, "record").decode(payload.data, dst)
            return
        src = np.frombuffer(payload.data, dtype=np.uint8)
        target = dst if dst.device.type == "cpu" else torch.empty(self._shape, dtype=self._dtype)
        try:
            view = target.view(torch.uint8).numpy()
        except RuntimeError:  # strides that a byte view cannot express
            target = torch.empty(self._shape, dtype=self._dtype)
            view = target.view(torch.uint8).numpy()
        np.copyto(view, src.reshape(view.shape))
        if target is not dst:
            dst.copy_(target)
