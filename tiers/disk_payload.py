"""Payloads between tensors and slots: gather writes, scatter reads, checksums.

A payload is one block's bytes in row-major order (codec 0, raw). Its xxh3-64 covers the
block's index key, parent hash and token ids (`disk_index.checksum`) and then the payload, so
bytes that landed in the wrong slot, a torn write, or an entry moved under another key all
fail. Writes of blocks in consecutive slots go out as one `pwritev` straight from the source
tensors; reads of consecutive slots come in as one `preadv` straight into the destinations,
each block then verified in place (a host destination that fails keeps undefined bytes: it
was read there to be checked). Device tensors and views without a byte layout go through a
host staging copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from tiers.blockbatch import BlockBatch
from tiers.blockcopy import host_bytes
from tiers.disk_files import Pieces, SlotFiles, array_pieces, tensor_pieces
from tiers.disk_index import Entry, checksum

_MAX_RUN_BYTES = 256 << 20  # one read call at most; bounds the staging a device read needs


class Prepared(NamedTuple):
    """A block ready to write: its index key, its entry (slot still 0), its payload pieces
    and whatever keeps them alive (a staging copy)."""

    key: bytes
    entry: Entry
    pieces: Pieces
    keep: torch.Tensor | None


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


def payload_sum(key: bytes, parent: bytes, tokens: bytes, pieces: Pieces) -> int:
    h = checksum(key, parent, tokens)
    for piece in pieces:
        h.update(piece)
    return int(h.intdigest())


def runs(slots: Sequence[int], max_blocks: int) -> list[tuple[int, int]]:
    """(start, end) index ranges of `slots` over which slots step by exactly +1."""
    out = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - start >= max_blocks:
            out.append((start, i))
            start = i
    return out


def write_payloads(files: SlotFiles, slot_bytes: int, blocks: Sequence[Prepared], slots: Sequence[int]) -> None:
    """Write `blocks[i]` into slot `slots[i]`, one gathered write per run of consecutive
    slots. Raises `OSError` if the file system refuses (nothing is committed then)."""
    pad = slot_bytes - blocks[0].entry.length if blocks else 0
    gap = memoryview(bytes(pad)) if pad else None
    for start, end in runs(slots, max(1, _MAX_RUN_BYTES // slot_bytes)):
        pieces: Pieces = []
        for b in blocks[start:end]:
            pieces.extend(b.pieces)
            if gap is not None and end - start > 1:
                pieces.append(gap)  # keeps the next block at its slot's offset
        files.write(slot_bytes, slots[start], pieces)


class ReadResult(NamedTuple):
    """How many leading blocks were read and verified, and the first that failed (if any)."""

    num_ok: int
    failed: int | None


def read_payloads(files: SlotFiles, keys: Sequence[bytes], entries: Sequence[Entry],
                  dsts: Sequence[torch.Tensor], dtype: torch.dtype, shape: Sequence[int],
                  on_block: Callable[[int], None] | None = None) -> ReadResult:
    """Read `entries[i]`'s payload into `dsts[i]` and verify it, in order; stop at the first
    block whose bytes are short or fail their checksum."""
    n = 0
    slots = [e.slot for e in entries]
    if not entries:
        return ReadResult(0, None)
    slot_bytes = entries[0].slot_bytes
    for start, end in runs(slots, max(1, _MAX_RUN_BYTES // slot_bytes)):
        targets: list[tuple[Pieces, torch.Tensor | None]] = []
        for i in range(start, end):
            pieces = tensor_pieces(dsts[i])
            if pieces is not None:
                targets.append((pieces, None))
            else:
                staging = torch.empty(tuple(shape), dtype=dtype)
                staged = tensor_pieces(staging)
                assert staged is not None
                targets.append((staged, staging))
        pad = slot_bytes - entries[start].length
        gap = memoryview(bytearray(pad)) if pad and end - start > 1 else None
        flat: Pieces = []
        for pieces, _ in targets:
            flat.extend(pieces)
            if gap is not None:
                flat.append(gap)
        got = files.read(slot_bytes, slots[start], flat)
        for i in range(start, end):
            e = entries[i]
            pieces, staged_copy = targets[i - start]
            if got < (i - start) * slot_bytes + e.length or payload_sum(keys[i], e.parent, e.tokens, pieces) != e.xxh:
                return ReadResult(n, i)
            if staged_copy is not None:
                dsts[i].copy_(staged_copy)
            n += 1
            if on_block is not None:
                on_block(i)
    return ReadResult(n, None)
