"""The batch description one model forward step consumes: flattened tokens plus paging metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from kvstore.errors import InvalidInputError

# Pad value of `ForwardBatch.block_tables` past the end of a request's blocks.
NO_BLOCK = -1


class RequestChunk(NamedTuple):
    """What one request feeds in one step.

    Attributes:
        token_ids: the tokens fed now: the uncached suffix of a prompt, or one decode token.
        num_computed_tokens: tokens whose KV is already in the request's blocks; the fed
            tokens take positions `num_computed_tokens ..`.
        block_ids: the request's block table; it must cover `num_computed_tokens +
            len(token_ids)` tokens (extra trailing blocks are allowed and left untouched).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """One forward step over `num_reqs` requests, their fed tokens laid end to end.

    Request `i` feeds `query_lens[i]` tokens at positions `context_lens[i] - query_lens[i] ..
    context_lens[i] - 1`; token `t` at position `p` writes its KV to `slot_mapping[t] =
    block_tables[i, p // block_size] * block_size + p % block_size`. Tensors live on the
    model's device; the lengths are host ints so that no step needs a device sync to plan.

    Attributes:
        input_ids: int64 `[num_tokens]`.
        positions: int64 `[num_tokens]`.
        slot_mapping: int64 `[num_tokens]`, pairwise distinct.
        block_tables: int64 `[num_reqs, max_blocks]`, padded with `NO_BLOCK`.
        query_lens: tokens fed per request (each >= 1).
        context_lens: tokens of KV per request after this step (computed + fed).
        block_size: tokens per block of the paged KV cache.
        max_block_id: the largest block id any request uses (checked against the cache).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int
    max_block_id: int

    def __post_init__(self) -> None:
        num_tokens = sum(self.query_lens)
        for name in ("input_ids", "positions", "slot_mapping"):
            shape = tuple(getattr(self, name).shape)
            if shape != (num_tokens,):
                raise InvalidInputError(
                    f"ForwardBatch.{name} has shape {shape}, expected ({num_tokens},)"
                )
        if len(self.context_lens) != len(self.query_lens) or self.block_tables.dim() != 2:
            raise InvalidInputError("ForwardBatch: query_lens, context_lens, block_tables disagree")
        if self.block_tables.shape[0] != len(self.query_lens):
            raise InvalidInputError(
                f"ForwardBatch.block_tables has {self.block_tables.shape[0]} rows for "
                f"{len(self.query_lens)} requests"
            )
        for q, c in zip(self.query_lens, self.context_lens, strict=True):
            if not 1 <= q <= c:
                raise InvalidInputError(
                    f"ForwardBatch: need 1 <= query_len <= context_len, got {q}, {c}"
                )

    @classmethod
    def build(
        cls,
        chunks: Sequence[RequestChunk],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Lay out `chunks` (in order) as one batch on `device`.

        Raises:
            InvalidInputError: no chunk, an empty chunk, negative ids or counts, a block
                table too short for its context, or two tokens mapped to the same slot.
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise InvalidInputError(f"block_size must be a positive int, got {block_size!r}")
        if not chunks:
            raise InvalidInputError("a ForwardBatch needs at least one request")
        ids, positions, slots, tables = [], [], [], []
        query_lens, context_lens = [], []
        for i, chunk in enumerate(chunks):
            token_ids = torch.as_tensor(chunk.token_ids, dtype=torch.int64).reshape(-1)
            table = torch.as_tensor(chunk.block_ids, dtype=torch.int64).reshape(-1)
            start, num_new = chunk.num_computed_tokens, token_ids.numel()
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise InvalidInputError(
                    f"request {i}: num_computed_tokens={start!r} is not an int >= 0"
                )
            if num_new == 0:
                raise InvalidInputError(f"request {i} feeds no token")
            if (token_ids < 0).any() or (table < 0).any():
                raise InvalidInputError(f"request {i}: token and block ids must be >= 0")
            context_len = start + num_new
            num_blocks = -(-context_len // block_size)
            if table.numel() < num_blocks:
                raise InvalidInputError(
                    f"request {i}: {table.numel()} blocks cannot hold {context_len} tokens "
                    f"of block_size {block_size}"
                )
            pos = torch.arange(start, context_len, dtype=torch.int64)
            ids.append(token_ids)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            tables.append(table[:num_blocks])
            query_lens.append(num_new)
            context_lens.append(context_len)
        slot_mapping = torch.cat(slots)
        if torch.unique(slot_mapping).numel() != slot_mapping.numel():
            raise InvalidInputError("two tokens of the batch map to the same KV slot")
        max_blocks = max(t.numel() for t in tables)
        block_tables = torch.full((len(tables), max_blocks), NO_BLOCK, dtype=torch.int64)
        for row, table in enumerate(tables):
            block_tables[row, : table.numel()] = table
        return cls(
            input_ids=torch.cat(ids).to(device),
            positions=torch.cat(positions).to(device),
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            block_size=block_size,
            max_block_id=int(max(t.max() for t in tables)),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @cached_property
    def query_starts(self) -> tuple[int, ...]:
        """Index in the flattened tokens of each request's first fed token."""
        starts, total = [], 0
        for q in self.query_lens:
            starts.append(total)
            total += q
        return tuple(starts)

    @cached_property
    def last_token_indices(self) -> torch.Tensor:
        """int64 `[num_reqs]` on the batch's device: each request's last fed token."""
        last = [s + q - 1 for s, q in zip(self.query_starts, self.query_lens, strict=True)]
        return torch.tensor(last, dtype=torch.int64, device=self.input_ids.device)
