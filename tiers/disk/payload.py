"""Payloads between tensors and slots: gather writes, scatter reads, checksums.

A raw payload (codec 0) is one block's bytes in row-major order; an encoded one is what the
tier's codec made of it (`tiers/disk/codec.py`), shorter than its slot. Its xxh3-64 covers
what binds it to its entry (`disk_index.checksum`: key, codec, layout, length, parent,
extras, token ids) and then the payload as stored, so bytes that landed in the wrong slot, a
torn write, or an entry moved under another key all fail. Writes of blocks in consecutive
slots go out as gathered `pwritev` calls straight from the source tensors (or the encoded
bytes); raw reads come in as `preadv` calls straight into the destinations, each block
verified in place (a host destination that fails keeps undefined bytes: it was read there to
be checked), encoded ones into a buffer that is verified, then decoded into the destination.
Both move about a MiB per call and hash it while it is in the CPU cache, so the checksum
costs no extra trip through memory. Device tensors and views without a byte layout go
through a host staging copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from tiers.disk.files import Pieces, SlotFiles, array_pieces, read_all, tensor_pieces, write_all
from tiers.disk.index import CODEC_RAW, Entry, checksum
from tiers.errors import CorruptRecordError
from tiers.shared.blockbatch import BlockBatch
from tiers.shared.blockcopy import host_bytes

_MAX_RUN_BYTES = 1 << 30  # slots per run at most (keeps the Python lists of one run bounded)
_CHUNK = 1 << 20  # bytes per gathered read or write: hashed while they are in the cache


class Prepared(NamedTuple):
    """A block ready to write: its index key, its entry (slot still 0), its payload pieces
    and whatever keeps them alive (a staging copy, the encoded bytes)."""

    key: bytes
    entry: Entry
    pieces: Pieces
    keep: object


def source_pieces(srcs: Sequence[torch.Tensor], positions: Sequence[int]) -> list[tuple[Pieces, torch.Tensor | None]]:
    """Payload pieces of `srcs[p]` for each position, views where the memory allows, else a
    contiguous host copy (returned too, to keep it alive)."""
    rows = host_bytes(srcs.rows) if isinstance(srcs, BlockBatch) else None
    out: list[tuple[Pieces, torch.Tensor | None]] = []
    for p in positions:
        pieces: Pieces | None = None
        if rows is not None:
            pieces = array_pieces(rows[srcs.row_ids[p]])  # type: ignore[attr-defined]  # a BlockBatch
        if pieces is None:
            pieces = tensor_pieces(srcs[p])
        if pieces is not None:
            out.append((pieces, None))
            continue
        staged = srcs[p].detach().to("cpu", copy=True).contiguous()
        staged_pieces = tensor_pieces(staged)
        assert staged_pieces is not None  # a contiguous host tensor always has a byte view
        out.append((staged_pieces, staged))
    return out


def payload_sum(key: bytes, entry: Entry, pieces: Pieces) -> int:
    h = checksum(key, entry)
    for piece in pieces:
        h.update(piece)
    return int(h.intdigest())


def runs(slots: Sequence[int], max_blocks: int, sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(start, end) index ranges of `slots` over which slots step by exactly +1 (and, given
    `sizes`, the slot size stays the same), at most `max_blocks` long."""
    out = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - start >= max_blocks or (
                sizes is not None and sizes[i] != sizes[i - 1]):
            out.append((start, i))
            start = i
    return out


def _cut(pieces: Pieces) -> Pieces:
    """The pieces, the ones larger than a chunk cut into chunk-sized views."""
    if all(p.nbytes <= _CHUNK for p in pieces):
        return pieces
    out: Pieces = []
    for p in pieces:
        n = p.nbytes
        if n <= _CHUNK:
            out.append(p)
        else:
            flat = p if isinstance(p, np.ndarray) else np.frombuffer(p, np.uint8)
            out.extend(flat[i : i + _CHUNK] for i in range(0, n, _CHUNK))
    return out


def write_payloads(files: SlotFiles, slot_bytes: int, blocks: Sequence[Prepared], slots: Sequence[int]) -> list[int]:
    """Write `blocks[i]` (slots of `slot_bytes`) into slot `slots[i]` and return each block's
    checksum. Each run of consecutive slots is one stream of gathered writes of about `_CHUNK`
    bytes (a payload shorter than its slot is followed by zeros up to the next one); every
    piece is hashed just before it is written, so the write copies it from the cache. Raises
    `OSError` if the file system refuses (nothing is committed then)."""
    sums: list[int] = []
    if not blocks:
        return sums
    fd = files.fd(slot_bytes)
    zeros: dict[int, memoryview] = {}

    def tail(b: Prepared) -> Pieces:  # keeps the next block at its slot's offset
        pad = slot_bytes - b.entry.length
        if not pad:
            return []
        if pad not in zeros:
            zeros[pad] = memoryview(bytes(pad))
        return [zeros[pad]]

    for start, end in runs(slots, max(1, _MAX_RUN_BYTES // slot_bytes)):
        offset = slots[start] * slot_bytes
        chunk: Pieces = []
        size = 0
        for j in range(start, end):
            b = blocks[j]
            h = checksum(b.key, b.entry)
            pad = slot_bytes - b.entry.length if j + 1 < end else 0
            if b.entry.length <= _CHUNK:  # a small block: hashed whole, written with its neighbours
                for piece in b.pieces:
                    h.update(piece)
                chunk += b.pieces
                size += b.entry.length
                if pad:
                    chunk += tail(b)
                    size += pad
                if size >= _CHUNK:
                    write_all(fd, chunk, offset)
                    offset, chunk, size = offset + size, [], 0
            else:  # a large one: a chunk at a time, each hashed just before its write
                if chunk:
                    write_all(fd, chunk, offset)
                    offset, chunk, size = offset + size, [], 0
                part: Pieces = []
                part_size = 0
                for piece in _cut(b.pieces):
                    h.update(piece)
                    part.append(piece)
                    part_size += piece.nbytes
                    if part_size >= _CHUNK:
                        write_all(fd, part, offset)
                        offset, part, part_size = offset + part_size, [], 0
                if part:
                    write_all(fd, part, offset)
                    offset += part_size
                offset += pad
            sums.append(int(h.intdigest()))
        if chunk:
            write_all(fd, chunk, offset)
    return sums


class ReadResult(NamedTuple):
    """How many leading blocks were read, verified and delivered; the first that failed (if
    any), and whether it failed to decode (its bytes verified: damage, not a race)."""

    num_ok: int
    failed: int | None
    undecodable: bool = False


Decode = Callable[[Entry, np.ndarray, torch.Tensor], None]  # an encoded payload into a destination
Target = tuple[Pieces, object]  # the pieces a block is read into, and its staging copy or encoded buffer


def _targets(entries: Sequence[Entry], dsts: Sequence[torch.Tensor], dtype: torch.dtype,
             shape: Sequence[int]) -> list[Target]:
    """Where each block is read to: its destination's own memory, a host staging copy, or (an
    encoded payload) a buffer of its length."""
    rows = host_bytes(dsts.rows) if isinstance(dsts, BlockBatch) else None
    out: list[Target] = []
    for i, e in enumerate(entries):
        if e.codec != CODEC_RAW:
            buf = np.empty(e.length, dtype=np.uint8)
            out.append((_cut([buf]), buf))
            continue
        pieces = array_pieces(rows[dsts.row_ids[i]]) if rows is not None else tensor_pieces(dsts[i])  # type: ignore[attr-defined]
        if pieces is None:
            staging = torch.empty(tuple(shape), dtype=dtype)
            pieces = tensor_pieces(staging)
            assert pieces is not None  # a contiguous host tensor always has a byte view
            out.append((_cut(pieces), staging))
        else:
            out.append((_cut(pieces), None))
    return out


def read_payloads(files: SlotFiles, keys: Sequence[bytes], entries: Sequence[Entry], dsts: Sequence[torch.Tensor],
                  dtype: torch.dtype, shape: Sequence[int], decode: Decode | None = None) -> ReadResult:
    """Read `entries[i]`'s payload into `dsts[i]` and verify it, in order (encoded payloads
    are then decoded by `decode`); stop at the first block whose bytes are short, fail their
    checksum or do not decode (its destination, and those of the blocks read with it, then
    hold undefined bytes). Reads of about `_CHUNK` bytes (several small blocks of one slot
    size, or a part of a large one), each hashed right after it lands, while it is in the
    cache."""
    if not entries:
        return ReadResult(0, None)
    slots = [e.slot for e in entries]
    sizes = [e.slot_bytes for e in entries]
    targets = _targets(entries, dsts, dtype, shape)
    n = 0
    for start, end in runs(slots, max(1, _CHUNK // min(sizes)), sizes):  # small blocks: one read per run
        e = entries[start]
        slot_bytes = e.slot_bytes
        fd = files.fd(slot_bytes)
        if end - start > 1 or e.length <= _CHUNK:
            flat: Pieces = []
            for j in range(start, end):
                flat += targets[j][0]
                if j + 1 < end and slot_bytes > entries[j].length:
                    flat.append(memoryview(bytearray(slot_bytes - entries[j].length)))
            got = read_all(fd, flat, slots[start] * slot_bytes)
            for j in range(start, end):
                if not _verified(keys[j], entries[j], targets[j], got >= (j - start) * slot_bytes + entries[j].length):
                    return ReadResult(n, j)
                if not _land(entries[j], dsts[j], targets[j], decode):
                    return ReadResult(n, j, True)
                n += 1
            continue
        pieces = targets[start][0]  # one large block, a chunk at a time
        h = checksum(keys[start], e)
        offset, i, ok = slots[start] * slot_bytes, 0, True
        while i < len(pieces) and ok:
            chunk: Pieces = []
            size = 0
            while i < len(pieces) and (not chunk or size + pieces[i].nbytes <= _CHUNK):
                chunk.append(pieces[i])
                size += pieces[i].nbytes
                i += 1
            ok = read_all(fd, chunk, offset) == size
            offset += size
            for piece in chunk:
                h.update(piece)
        if not ok or h.intdigest() != e.xxh:
            return ReadResult(n, start)
        if not _land(e, dsts[start], targets[start], decode):
            return ReadResult(n, start, True)
        n += 1
    return ReadResult(n, None)


def _verified(key: bytes, e: Entry, target: Target, complete: bool) -> bool:
    h = checksum(key, e)
    for piece in target[0]:
        h.update(piece)
    return complete and h.intdigest() == e.xxh


def _land(e: Entry, dst: torch.Tensor, target: Target, decode: Decode | None) -> bool:
    """Deliver a verified block to its destination: decode an encoded payload, or copy a raw
    one from its staging copy (if it needed one). False if the payload does not decode."""
    held = target[1]
    if e.codec != CODEC_RAW:
        assert decode is not None and isinstance(held, np.ndarray)
        try:
            decode(e, held, dst)
        except CorruptRecordError:
            return False
    elif isinstance(held, torch.Tensor):
        dst.copy_(held)
    return True
