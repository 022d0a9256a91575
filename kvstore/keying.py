"""`Keyer`: a caller's tokens, or an engine's own block ids, as one store's block keys.

It validates tokens and extra keys, hashes the chain (incrementally with a `BlockChain`, so a
growing request is hashed once), and builds the `BlockKey`s the tiers take: each with its
token ids (verified on every hit), its parent, its extras (for KV events) and its tenant (for
quotas). Keys of a token sequence come as `ChainKeys`, built only when first read: a lookup
needs their hashes alone. An engine's ids are hashed into the store's namespace
(`hashing.engine_block_hash`). Pure: the tiers keep the keys whole, so what they report of a
block needs no help.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from kvstore.config import StoreConfig, require_int
from kvstore.errors import InvalidInputError, LayoutMismatchError
from kvstore.hashing import (
    BlockChain,
    BlockHash,
    ExtraKeys,
    as_token_array,
    chain_hashes,
    check_extra_keys,
    engine_block_hash,
    tenant_of,
)
from tiers.keys import BlockKey


class ChainKeys(Sequence[BlockKey]):
    """The keys of consecutive blocks `first_block, first_block + 1, ...` of one hashed token
    sequence, in prefix order. `hashes` is there at once; the `BlockKey`s are built (all of
    them, once) when an element is first read, so a lookup never builds one. A slice of
    unbuilt keys stays unbuilt. Immutable, but built from the token array it was made from:
    a caller must not change that array while it still uses the keys."""

    __slots__ = ("_arr", "_extra_keys", "_first", "_keyer", "_keys", "_parent", "hashes")

    def __init__(self, keyer: Keyer, arr: np.ndarray, hashes: list[BlockHash], extra_keys: ExtraKeys | None,
                 first_block: int, parent: BlockHash | None) -> None:
        self._keyer, self._arr, self._extra_keys = keyer, arr, extra_keys
        self.hashes = hashes  # never mutated: every slice copies
        self._first, self._parent = first_block, parent
        self._keys: list[BlockKey] | None = None

    def __len__(self) -> int:
        return len(self.hashes)

    def _built(self) -> list[BlockKey]:
        if self._keys is None:
            self._keys = self._keyer.build_keys(self._arr, self.hashes, self._extra_keys, first_block=self._first,
                                          parent=self._parent) if self.hashes else []
        return self._keys

    @overload
    def __getitem__(self, index: int) -> BlockKey: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[BlockKey]: ...

    def __getitem__(self, index: int | slice) -> BlockKey | Sequence[BlockKey]:
        if not isinstance(index, slice):
            return self._built()[index]
        if self._keys is not None:
            return self._keys[index]
        start, stop, step = index.indices(len(self.hashes))
        if step != 1:
            return self._built()[index]
        stop = max(start, stop)
        b = self._keyer.config.block_size
        parent = self.hashes[start - 1] if start else self._parent
        return ChainKeys(self._keyer, self._arr[start * b : stop * b], self.hashes[start:stop], self._extra_keys,
                         self._first + start, parent)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._built())


def key_hashes(keys: Sequence[BlockKey]) -> list[BlockHash]:
    """The block hashes of `keys` (of `ChainKeys` without building a key)."""
    return keys.hashes if isinstance(keys, ChainKeys) else [k.block_hash for k in keys]


class Keyer:
    """Block keys in the namespace rooted at `seed` (see the module docstring)."""

    def __init__(self, config: StoreConfig, seed: BlockHash) -> None:
        self.config, self.seed = config, seed
        # Keys carry token ids and extras even without token verification: KV events announce them.
        self.describe = config.events_endpoint is not None

    def chain(self, extra_keys: ExtraKeys | None = None) -> BlockChain:
        """A `BlockChain` in this namespace for one growing sequence."""
        return BlockChain(self.seed, self.config.block_size, self.config.hash_algo, check_extra_keys(extra_keys))

    def hashes(self, tokens: object, extra_keys: ExtraKeys | None,
               chain: BlockChain | None = None) -> tuple[np.ndarray, list[BlockHash]]:
        """`tokens` as validated uint32 ids and the keys of their full blocks (through `chain`
        when given, hashing only blocks it has not hashed yet). `InvalidInputError` for bad
        tokens, extra keys, or a chain of another namespace or other extra keys."""
        check_extra_keys(extra_keys)
        arr = as_token_array(tokens)
        cfg = self.config
        if chain is None:
            return arr, chain_hashes(arr, cfg.block_size, self.seed, extra_keys, cfg.hash_algo)
        if not isinstance(chain, BlockChain) or (chain.seed, chain.block_size, chain.algo, chain.extra_keys) != (
                self.seed, cfg.block_size, cfg.hash_algo, extra_keys):
            raise InvalidInputError("chain must come from this store's chain() with the same extra_keys")
        return arr, chain.hashes_of(arr)

    def build_keys(self, arr: np.ndarray, hashes: Sequence[BlockHash], extra_keys: ExtraKeys | None, *,
             first_block: int = 0, parent: BlockHash | None = None) -> list[BlockKey]:
        """The `BlockKey`s of `hashes`, blocks `first_block, first_block + 1, ...` of a sequence
        hashed with `extra_keys`, whose tokens from block `first_block` on are `arr`; `parent`
        is the key of block `first_block - 1` (needed when `first_block > 0`)."""
        if first_block and parent is None:
            raise InvalidInputError("keys from block > 0 need the parent key")
        b = self.config.block_size
        tenant = tenant_of(self.seed, extra_keys)
        parents = [parent if first_block else self.seed, *hashes[:-1]]
        if not self.config.verify_tokens and not self.describe:
            return [BlockKey(h, b"", p, None, tenant) for h, p in zip(hashes, parents)]
        buf = arr.tobytes()
        step = b * 4
        if not self.describe:
            return [BlockKey(h, buf[i * step : (i + 1) * step], parents[i], None, tenant)
                    for i, h in enumerate(hashes)]
        return [BlockKey(h, buf[i * step : (i + 1) * step], parents[i],
                         extra_keys.block_extras(first_block + i, b) if extra_keys is not None else b"", tenant)
                for i, h in enumerate(hashes)]

    def token_keys(self, tokens: object, extra_keys: ExtraKeys | None = None, *, chain: BlockChain | None = None,
                   first_block: int = 0, num_blocks: int | None = None) -> ChainKeys:
        """The keys of full blocks `first_block .. first_block + num_blocks - 1` of `tokens`
        (default: every full block from `first_block` on), hashed through `chain` when given.
        `LayoutMismatchError` if `tokens` do not cover those blocks; `InvalidInputError`
        (`InvalidTokensError`) for bad tokens, extra keys, chain or counts."""
        require_int("first_block", first_block, 0, InvalidInputError)
        if num_blocks is not None:
            require_int("num_blocks", num_blocks, 0, InvalidInputError)
        arr, hashes = self.hashes(tokens, extra_keys, chain)
        if num_blocks is None and first_block > len(hashes):
            raise LayoutMismatchError(f"first_block {first_block} is past the {len(hashes)} full blocks "
                                      f"of {len(arr)} tokens")
        end = len(hashes) if num_blocks is None else first_block + num_blocks
        if end > len(hashes):
            b = self.config.block_size
            raise LayoutMismatchError(f"blocks {first_block}..{end - 1} need {end * b} tokens, got {len(arr)}")
        return self.lazy_keys(arr, hashes, extra_keys, first_block, end)

    def lazy_keys(self, arr: np.ndarray, hashes: list[BlockHash], extra_keys: ExtraKeys | None, first: int,
                  end: int) -> ChainKeys:
        """`ChainKeys` of blocks `first .. end - 1` of a sequence `hashes` keys (`hashes`'
        tokens `arr`, extra keys `extra_keys`), nothing built yet. Takes `hashes` over when
        they are all of it: the caller must not change that list afterwards."""
        b = self.config.block_size
        whole = first == 0 and end == len(hashes)  # the caller's own list: no copy
        return ChainKeys(self, arr[first * b : end * b], hashes if whole else hashes[first:end], extra_keys, first,
                         hashes[first - 1] if first else None)

    def engine_keys(self, ids: Sequence[object], tokens: Sequence[object | None] | None = None) -> list[BlockKey]:
        """The keys of blocks an engine names by its own ids (bytes or text; see
        `hashing.engine_block_hash`), in this store's namespace, with `tokens[i]` (one
        block of token ids, or None) kept for verification where this store verifies
        tokens. Their parents are unknown (KV events do not announce them to routers).
        `InvalidInputError` naming a bad id or token block, and nothing is built."""
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
            raise InvalidInputError(f"engine block ids must be a sequence of bytes or str, got {type(ids).__name__}")
        if tokens is not None and (isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence)
                                   or len(tokens) != len(ids)):
            raise InvalidInputError(f"tokens must be None or one block of token ids (or None) per id: "
                                    f"{len(ids)} ids, got {tokens!r:.80}")
        algo, b, verify = self.config.hash_algo, self.config.block_size, self.config.verify_tokens
        hashes = [engine_block_hash(self.seed, key, algo) for key in ids]
        token_bytes = [b""] * len(ids)
        for i, block in enumerate(tokens or ()):
            if block is None:
                continue
            arr = as_token_array(block)
            if len(arr) != b:
                raise LayoutMismatchError(f"tokens[{i}] holds {len(arr)} token ids; a block holds {b}")
            token_bytes[i] = arr.tobytes() if verify else b""
        return [BlockKey(h, t) for h, t in zip(hashes, token_bytes)]
