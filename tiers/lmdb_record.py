"""A self-checking block record: encoding, validation and the payload copy-out.

The remote tier stores its values in this form (it is the first disk format's record; the
disk tier now keeps payloads in slot files and their checks in its index, `tiers/disk_*.py`).

Record = b"KVS1" | u32 header length | msgpack header | payload. The header names the
format version, the key, the namespace of the store that wrote it, the layout (dtype,
shape), the payload's codec ("c", `tiers/codecs`; absent: raw bytes) and length, the
block's token ids, optionally its parent's hash ("par") and extra keys ("ext") for KV-event
announcements after a restart, and an xxh3-64 checksum over key, namespace, tokens, parent,
extras and the payload as stored (encoded). Any mismatch on read is a `CorruptRecordError`,
and so is an encoded payload that does not decode. A record of a codec this reader does not
know, cannot load (its library missing) or does not accept (a lossy one for a reader that
wants exact KV) is an `UnverifiableRecordError`: a miss, left in place. Records written
before "par"/"ext" or "c" existed verify as before.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgpack
import numpy as np
import torch
import xxhash

from tiers.base import BlockHash, BlockKey
from tiers.blockcopy import copy_block
from tiers.codecs import CodecKind, CodecSpec
from tiers.errors import CorruptRecordError
from tiers.record_checks import LayoutCodecs, check_tokens

FORMAT_VERSION = 1
_MAGIC = b"KVS1"
_PREFIX = struct.Struct("<4sI")


class Payload(NamedTuple):
    """A validated record's payload as stored, and the codec id its header names."""

    data: memoryview
    codec_id: int


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

    def is_own_layout(self, hdr: dict[str, object]) -> bool:
        return hdr.get("dtype") == self._dtype_name and hdr.get("shape") == self._shape

    def _header(self, key: BlockKey, checksum: bytes, codec_id: int = 0, length: int | None = None) -> bytes:
        fields = {"v": FORMAT_VERSION, "key": bytes(key.block_hash), "ns": self._namespace, "dtype": self._dtype_name,
                  "shape": self._shape, "n": self._block_bytes if length is None else length,
                  "tok": key.tokens if self._verify_tokens else b"", "xxh": checksum}
        if codec_id:
            fields["c"] = codec_id
        if key.parent is not None and key.extras is not None:
            fields["par"], fields["ext"] = bytes(key.parent), bytes(key.extras)
        return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]  # untyped: bytes

    @staticmethod
    def _described(key: BlockKey) -> bytes:
        """What the checksum covers of a key's parent and extras (b"" without them)."""
        if key.parent is None or key.extras is None:
            return b""
        return bytes(key.parent) + bytes(key.extras)

    @staticmethod
    def _checksum(block_hash: bytes, tokens: bytes, payload: memoryview | bytes) -> bytes:
        h = xxhash.xxh3_64()
        h.update(block_hash)
        h.update(tokens)
        h.update(payload)
        return h.digest()

    def encode(self, key: BlockKey, src: torch.Tensor) -> bytearray:
        """Build the record for one block: raw (one copy of the KV bytes), or encoded by this
        tier's codec. A block the codec cannot represent (infinite or NaN values for a lossy
        one) or does not make smaller (noise through a lossless one) is written raw."""
        encoded = None if self._writer is None else self._writer.encode(src)
        if encoded is not None and len(encoded) >= self._block_bytes:
            encoded = None
        codec_id = 0 if encoded is None else self._spec.kind.value
        length = self._block_bytes if encoded is None else len(encoded)
        hlen = len(self._header(key, bytes(8), codec_id, length))
        off = _PREFIX.size + hlen
        buf = bytearray(off + length)
        if encoded is None:
            payload = torch.frombuffer(buf, dtype=torch.uint8, offset=off, count=self._block_bytes)
            copy_block(payload.view(self._dtype).view(self._shape), src)
        else:
            buf[off:] = encoded
        tokens = key.tokens if self._verify_tokens else b""
        covered = self._namespace + tokens + self._described(key)
        header = self._header(key, self._checksum(key.block_hash, covered, memoryview(buf)[off:]), codec_id, length)
        buf[: _PREFIX.size] = _PREFIX.pack(_MAGIC, hlen)
        buf[_PREFIX.size : off] = header
        return buf

    @staticmethod
    def parse(value: memoryview | bytes, block_hash: bytes) -> tuple[dict[str, object], memoryview]:
        """A record's header and payload, checked for self-consistency only (magic, format,
        key, payload length, checksum over key, namespace tag, tokens and payload); raise
        `CorruptRecordError` if damaged. Says nothing about whether it is this tier's."""
        mv = memoryview(value)
        if len(mv) < _PREFIX.size:
            raise CorruptRecordError("record shorter than its prefix")
        magic, hlen = _PREFIX.unpack(mv[: _PREFIX.size])
        if magic != _MAGIC or _PREFIX.size + hlen > len(mv):
            raise CorruptRecordError("bad magic or header length")
        try:
            hdr = msgpack.unpackb(mv[_PREFIX.size : _PREFIX.size + hlen], raw=False)
        except Exception as exc:  # msgpack raises many types on garbage
            raise CorruptRecordError(f"undecodable header: {exc}") from None
        payload = mv[_PREFIX.size + hlen :]
        if not isinstance(hdr, dict) or hdr.get("v") != FORMAT_VERSION:
            raise CorruptRecordError("unknown record format")
        if hdr.get("key") != bytes(block_hash):
            raise CorruptRecordError("record stored under another key")
        if hdr.get("n") != len(payload):
            raise CorruptRecordError("payload length mismatch")
        tokens, ns, par, ext = hdr.get("tok"), hdr.get("ns", b""), hdr.get("par", b""), hdr.get("ext", b"")
        if not all(isinstance(f, bytes) for f in (tokens, ns, par, ext)):
            raise CorruptRecordError("bad token, namespace, parent or extras field")
        if RecordCodec._checksum(block_hash, ns + tokens + par + ext, payload) != hdr.get("xxh"):
            raise CorruptRecordError("checksum mismatch")
        return hdr, payload

    def decode(self, value: memoryview | bytes, key: BlockKey) -> Payload:
        """Validate a record as this tier's block `key` and return its payload; raise
        `CorruptRecordError` if damaged (`UnverifiableRecordError` if it is sound but has no
        token ids to check against `key.tokens`). The payload's encoding is checked by
        `copy_out`."""
        hdr, payload = self.parse(value, key.block_hash)
        if hdr.get("ns", self._namespace) != self._namespace:
            raise CorruptRecordError("record of another namespace under this key")
        codec_id = hdr.get("c", 0)
        if not isinstance(codec_id, int) or isinstance(codec_id, bool) or codec_id < 0:
            raise CorruptRecordError(f"bad codec field {codec_id!r}")
        if hdr.get("dtype") != self._dtype_name or hdr.get("shape") != self._shape or (
                codec_id == 0 and len(payload) != self._block_bytes):
            raise CorruptRecordError("record layout differs from this tier's")
        tokens = hdr["tok"]
        assert isinstance(tokens, bytes)  # `parse` checked it
        check_tokens(self._verify_tokens, key.tokens, tokens, "record")
        return Payload(payload, codec_id)

    @staticmethod
    def _read_header(value: memoryview | bytes) -> dict[str, object] | None:
        """A record's msgpack header, or None if it cannot be read."""
        try:
            _, hlen = _PREFIX.unpack(value[: _PREFIX.size])
            hdr = msgpack.unpackb(value[_PREFIX.size : _PREFIX.size + hlen], raw=False)
        except Exception:  # garbage of any kind: nothing can be read
            return None
        return hdr if isinstance(hdr, dict) else None

    def announced_key(self, value: memoryview | bytes, block_hash: bytes) -> BlockKey | None:
        """The key a record's header describes (token ids, parent, extras) if it is this
        namespace's and carries all three; else None. Reads the header only (the payload's
        checksum is checked when the block is read)."""
        hdr = self._read_header(value)
        if not hdr or hdr.get("ns") != self._namespace:
            return None
        tokens, par, ext = hdr.get("tok"), hdr.get("par"), hdr.get("ext")
        if not (isinstance(tokens, bytes) and tokens and isinstance(par, bytes) and isinstance(ext, bytes)):
            return None
        return BlockKey(BlockHash(bytes(block_hash)), tokens, par, ext)

    def owner(self, value: memoryview | bytes) -> bytes | None:
        """The namespace tag in a record's header; None if unreadable or absent (older records)."""
        ns = (self._read_header(value) or {}).get("ns")
        return ns if isinstance(ns, bytes) else None

    def copy_out(self, payload: Payload, dst: torch.Tensor) -> None:
        """Write a `decode`d payload into `dst`. Raises `CorruptRecordError` if an encoded
        payload does not decode, `UnverifiableRecordError` if its codec is unknown, missing
        its library, or lossy for a reader that does not accept it (`dst` may then hold part
        of the block)."""
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
