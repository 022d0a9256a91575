"""`Keyer`: a caller's tokens as one store's block keys.

It validates tokens and extra keys, hashes the chain (incrementally with a `BlockChain`, so a
growing request is hashed once), and builds the `BlockKey`s the tiers take: each with its
token ids (verified on every hit), its parent, its extras (for KV events) and its tenant (for
quotas). Pure: the tiers keep the keys whole, so what they report of a block needs no help.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.hashing import BlockChain, BlockHash, ExtraKeys, as_token_array, chain_hashes, check_extra_keys, tenant_of
from tiers.base import BlockKey


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

    def keys(self, arr: np.ndarray, hashes: Sequence[BlockHash], extra_keys: ExtraKeys | None, *,
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
