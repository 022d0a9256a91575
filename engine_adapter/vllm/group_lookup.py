"""The scheduler's lookup across KV cache groups and shards: the longest prefix every one of
them can serve.

A prefix of `n` blocks is a hit only if, for every group, every store of it (one per
tensor-parallel shard and pipeline stage) holds each block the group's rule says a hit of
`n` blocks needs: the whole prefix for full attention, the window or chunk before `n` for
windowed attention, the state at `n` for a state group. Each store is asked once per run of
consecutive blocks it holds (the engine API's `lookup`, which reads the keys' hashes
alone), so a lookup costs one walk per store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine_adapter.vllm.groups import GroupKind, GroupRule
from engine_adapter.vllm.worker_side import PENDING
from kvstore import ExtraKeys, KVCacheStore
from kvstore.hashing import BlockChain
from kvstore.keying import key_hashes
from tiers.keys import BlockKey, TierKind

PENDING_WAIT_S = 5.0  # the longest a lookup waits for this process's queued writes, in all


class _Runs:
    """Lazily, the length of the run of consecutive blocks a store holds from each block on."""

    def __init__(self, store: KVCacheStore, keys: Sequence[BlockKey]) -> None:
        self.store, self.keys = store, keys
        self._run: dict[int, int] = {}

    def from_block(self, i: int) -> int:
        if i not in self._run:
            r = self.store.blocks.lookup(self.keys[i:]).num_blocks
            for j in range(i, i + r + 1):  # inside a run, the rest of it; at its end, 0
                self._run[j] = r - (j - i)
        return self._run[i]


def unlocated_kind(store: KVCacheStore) -> TierKind:
    """The tier a block is taken to load from when the walk found it but the primary store no
    longer does: its fastest tier outside memory (disk, remote), else its slowest tier."""
    return next((t.kind for t in store.tiers if not t.traits.memory), store.tiers[-1].kind)


class GroupLookup:
    """Finds hits over `stores[g]`, every store that holds a part of group `g`'s blocks;
    `primary` is the group whose tiers the load policy weighs (the first full-attention one)."""

    def __init__(self, rules: Sequence[GroupRule], stores: Sequence[Sequence[KVCacheStore]], primary: int) -> None:
        if len(rules) != len(stores) or not 0 <= primary < len(rules):
            raise ValueError(f"{len(rules)} rules, {len(stores)} store lists, primary {primary}")
        self.rules, self.stores, self.primary = list(rules), [list(s) for s in stores], primary
        self.block_size = rules[0].block_size
        self._runs: list[list[_Runs]] = []
        self._limit = 0
        # The chain `locate` hashed the primary group's first store's keys with: a caller that
        # reads the same tokens from that store passes it on instead of hashing them again.
        self.primary_chain: BlockChain | None = None

    @property
    def every_store(self) -> list[KVCacheStore]:
        return [s for group in self.stores for s in group]

    def locate(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> list[TierKind]:
        """The tier of each block of the longest hit (as the primary group's first store holds
        it: in multiprocess mode every view is disk). A block still queued for writing in
        this process is waited for first (read-your-writes). Remembers the walk for `cut`."""
        self._runs = []
        self.primary_chain = None
        deadline = time.monotonic() + PENDING_WAIT_S
        for g, group in enumerate(self.stores):
            runs: list[_Runs] = []
            for store in group:
                chain = None
                if g == self.primary and not runs:
                    chain = self.primary_chain = store.chain(extra_keys)
                keys = store.keys(token_ids, extra_keys=extra_keys, chain=chain)
                if PENDING.any(store):
                    for h in key_hashes(keys):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break  # a stuck writer costs a miss, never a hang
                        PENDING.wait_for(store, h, left)
                runs.append(_Runs(store, keys))
            self._runs.append(runs)
        n = len(token_ids) // self.block_size
        for rule, runs in zip(self.rules, self._runs):
            if rule.kind is GroupKind.FULL:
                for r in runs:
                    n = min(n, r.from_block(0))
        self._limit = n
        n = self.cut(n)
        primary = self.stores[self.primary]
        if not primary or n == 0:
            return []  # no store to load from: a miss
        store = primary[0]
        kinds = store.blocks.lookup(self._runs[self.primary][0].keys[:n]).tiers
        return kinds + [unlocated_kind(store)] * (n - len(kinds))  # evicted since: the load will tell

    def cut(self, num_blocks: int) -> int:
        """The longest hit of at most `num_blocks` blocks that every group can serve (after
        `locate`, over its walk)."""
        n = min(num_blocks, self._limit)
        while n > 0 and not self._servable(n):
            n -= 1
        return n

    def _servable(self, n: int) -> bool:
        for rule, runs in zip(self.rules, self._runs):
            if rule.kind is GroupKind.FULL:
                continue  # the limit covers it
            needed = rule.needed(n)
            if needed and any(r.from_block(needed.start) < len(needed) for r in runs):
                return False
        return True
