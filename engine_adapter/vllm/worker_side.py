"""The connector's worker role: whole-block byte copies between vLLM's paged KV and the store,
synchronous, as the scheduler's plan says. Each request's block keys are hashed once and
extended as its blocks complete (one `BlockChain` per request)."""

from __future__ import annotations

import logging

import torch

from engine_adapter.vllm.paged_blocks import PagedKVBlocks
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.transfer_plan import BlockTransfer, StepPlan
from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError, DiskFullError
from kvstore.hashing import BlockChain

logger = logging.getLogger(__name__)


class ConnectorWorker:
    """Copies the blocks a step's plan names, in and out of vLLM's paged KV tensors."""

    def __init__(self, store: KVCacheStore, config: StoreConfig, layer_names: list[str], num_blocks: int,
                 stats: ConnectorStats) -> None:
        self.store = store
        self.config = config
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.stats = stats
        self.paged: PagedKVBlocks | None = None
        self._load_errors: set[int] = set()
        self._chains: dict[str, BlockChain] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember vLLM's paged KV tensors; check that their blocks match the store layout."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kvstrata: KV caches for layers {missing} were not registered")
        paged = PagedKVBlocks([kv_caches[n] for n in self.layer_names], self.num_blocks, self.config.block_size)
        if paged.layout != self.config.layout:
            raise ConfigError(
                f"kvstrata: vLLM's blocks hold {paged.layer_block_bytes} bytes per layer; the "
                f"KV cache spec promised {self.config.block_bytes // len(self.layer_names)}"
            )
        self.paged = paged

    def _paged(self) -> PagedKVBlocks:
        if self.paged is None:
            raise RuntimeError("kvstrata: transfer before register_kv_caches (a bug)")
        return self.paged

    def _chain(self, transfer: BlockTransfer) -> BlockChain:
        chain = self._chains.get(transfer.req_id)
        if chain is None or chain.extra_keys != transfer.extra_keys:
            chain = self._chains[transfer.req_id] = self.store.chain(transfer.extra_keys)
        return chain

    def load(self, plan: StepPlan) -> None:
        """Copy this step's store hits into vLLM's blocks (before the forward pass)."""
        for req_id in plan.finished:
            self._chains.pop(req_id, None)
        if not plan.loads:
            return
        paged = self._paged()
        bs = self.config.block_size
        for load in plan.loads:
            n = len(load.block_ids)
            staging = paged.staging(n)
            result = self.store.retrieve_into(load.token_ids, list(staging), first_block=load.first_block,
                                              extra_keys=load.extra_keys, chain=self._chain(load))
            paged.scatter(staging, load.block_ids[: result.num_blocks])
            for tier, count in result.blocks_per_tier.items():
                self.stats.count(f"load_tokens_{tier.value}", count * bs)
            if result.num_blocks < n:  # evicted since the lookup: vLLM recomputes these
                self._load_errors.update(load.block_ids[result.num_blocks :])
                self.stats.count("load_error_blocks", n - result.num_blocks)
        self.stats.write()

    def save(self, plan: StepPlan) -> None:
        """Copy this step's newly completed full blocks out of vLLM into the store."""
        if not plan.saves:
            return
        paged = self._paged()
        for save in plan.saves:
            staging = paged.staging(len(save.block_ids))
            paged.gather(save.block_ids, staging)
            try:
                written = self.store.store_blocks(save.token_ids, list(staging), first_block=save.first_block,
                                                  extra_keys=save.extra_keys, chain=self._chain(save))
            except DiskFullError as exc:  # a cache: a refused write is a later miss
                logger.warning("kvstrata: save refused: %s", exc)
                self.stats.count("save_refused_blocks", len(save.block_ids))
                continue
            self.stats.count("save_blocks", len(save.block_ids))
            self.stats.count("save_new_blocks", written)
        self.stats.write()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
