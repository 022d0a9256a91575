"""`KVStrataLLM`: greedy generation on the block pool, reusing cached prefixes from every tier.

For each request: hash its tokens, take the longest cached prefix (pool hits shared by
reference; CPU and disk hits loaded into fresh pool blocks), prefill only the rest, cache
full blocks as their KV is written (prompt and decode), free the blocks on finish. Each
request's prefill runs on its own, so its time to first token is its own; decode steps
run batched over the requests admitted together.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_adapter.runner.block_manager import ComputedBlocks, KVCacheManager
from engine_adapter.runner.forward_batch import ForwardBatch, RequestChunk
from engine_adapter.runner.model import LlamaModel
from kvstore.errors import ConfigError, InvalidInputError, LayoutMismatchError
from kvstore.hashing import ExtraKeys, as_token_array
from kvstore.store import KVCacheStore


@dataclass
class RequestStats:
    """What serving one request cost and where its prefix came from."""

    num_prompt_tokens: int
    num_cached_tokens: int = 0
    cached_tokens_per_tier: dict[str, int] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0

    @property
    def source(self) -> str:
        """The tier that served most of the prefix, or "recompute"."""
        if not self.cached_tokens_per_tier:
            return "recompute"
        return max(self.cached_tokens_per_tier.items(), key=lambda kv: kv[1])[0]


class GenerationResult(NamedTuple):
    """Generated token ids, the last prompt token's logits (float32) and the stats."""

    token_ids: list[int]
    prefill_logits: torch.Tensor
    stats: RequestStats


class KVStrataLLM:
    """Greedy generation with `model` over `store`'s block pool.

    Args:
        model: the runner's model; its KV layout must be the store's.
        store: a `KVCacheStore` with a block pool on the model's device.
        prefix_caching: reuse and cache prefixes (False: every prompt is recomputed and
            nothing is cached, the baseline).
    """

    def __init__(self, model: LlamaModel, store: KVCacheStore, *, prefix_caching: bool = True) -> None:
        want, have = model.config.kv_layout, store.config.layout
        if want != have:
            raise LayoutMismatchError(f"model KV layout {want} differs from the store's {have}")
        self.manager = KVCacheManager(store)  # ConfigError without a block pool
        if self.manager.allocator.device != model.device:
            raise ConfigError(f"pool on {self.manager.allocator.device} but model on {model.device}")
        self.model = model
        self.store = store
        self.allocator = self.manager.allocator
        self.block_size = store.config.block_size
        self.prefix_caching = prefix_caching
        self._next_id = 0

    # -- one request's phases ---------------------------------------------------------------
    def _admit(self, rid: str, prompt: list[int], extra_keys: ExtraKeys | None) -> RequestStats:
        mgr = self.manager
        mgr.add_request(rid, prompt, extra_keys)
        computed = mgr.get_computed_blocks(rid) if self.prefix_caching else ComputedBlocks(0, [], [])
        alloc = mgr.allocate_slots(rid, len(prompt) - computed.num_tokens, computed)
        stats = RequestStats(num_prompt_tokens=len(prompt), num_cached_tokens=alloc.num_computed_tokens)
        stats.cached_tokens_per_tier = {k.value: n * self.block_size for k, n in alloc.blocks_per_tier.items()}
        return stats

    def _forward(self, chunks: list[RequestChunk]) -> torch.Tensor:
        batch = ForwardBatch.build(chunks, self.block_size, device=self.model.device)
        logits: torch.Tensor = self.model(batch, self.allocator.kv_cache)
        return logits

    def _prefill(self, rid: str, stats: RequestStats) -> torch.Tensor:
        mgr = self.manager
        tokens = mgr.token_ids(rid)
        start = mgr.num_computed_tokens(rid)
        stats.num_prefill_tokens = len(tokens) - start
        t0 = time.perf_counter()
        logits = self._forward([RequestChunk(tokens[start:], start, mgr.block_table(rid))])[0]
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self.store.load_policy.observe_prefill(len(tokens) - start, time.perf_counter() - t0)
        mgr.commit(rid, len(tokens), cache_blocks=self.prefix_caching)
        return logits

    # -- the entry point --------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        extra_keys: ExtraKeys | None = None,
    ) -> list[GenerationResult]:
        """Greedy-decode `max_new_tokens` tokens for each prompt (token ids), in order.

        Requests are admitted in order while the pool can hold their prompt plus every
        token they will generate; admitted requests are prefilled one by one and decoded
        together. Raises `InvalidInputError` for an empty prompt or one that cannot fit.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        clean = [as_token_array(p).tolist() for p in prompts]
        for i, p in enumerate(clean):
            if not p:
                raise InvalidInputError(f"prompt {i} is empty")
            if max(p) >= self.model.config.vocab_size:
                raise InvalidInputError(f"prompt {i} has a token id >= vocab_size={self.model.config.vocab_size}")
        results: list[GenerationResult | None] = [None] * len(clean)
        pending = list(range(len(clean)))
        while pending:
            wave = self._take_wave(clean, pending, max_new_tokens)
            pending = pending[len(wave) :]
            for idx, res in zip(wave, self._run_wave([clean[i] for i in wave], max_new_tokens, extra_keys)):
                results[idx] = res
        return [r for r in results if r is not None]

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def _take_wave(self, prompts: list[list[int]], pending: list[int], max_new: int) -> list[int]:
        budget = self.allocator.num_blocks
        wave, used = [], 0
        for i in pending:
            need = self._blocks_for(len(prompts[i]) + max_new)
            if need > budget:
                raise InvalidInputError(
                    f"prompt {i} needs {need} blocks with its output; the pool has {budget}"
                )
            if used + need > budget:
                break
            wave.append(i)
            used += need
        return wave

    def _run_wave(self, prompts: list[list[int]], max_new: int, extra_keys: ExtraKeys | None) -> list[GenerationResult]:
        mgr = self.manager
        rids, stats, outputs, logits0 = [], [], [], []
        try:
            for prompt in prompts:
                rid = f"req-{self._next_id}"
                self._next_id += 1
                t0 = time.perf_counter()
                st = self._admit(rid, prompt, extra_keys)
                rids.append(rid)
                logits = self._prefill(rid, st)
                first = int(torch.argmax(logits))
                st.ttft_s = time.perf_counter() - t0
                stats.append(st)
                outputs.append([first])
                logits0.append(logits.detach().to("cpu"))
            t0 = time.perf_counter()
            for _ in range(max_new - 1):
                chunks = []
                for rid, out in zip(rids, outputs):
                    n = len(mgr.token_ids(rid))
                    mgr.append_tokens(rid, [out[-1]])
                    mgr.allocate_slots(rid, 1)
                    chunks.append(RequestChunk([out[-1]], n, mgr.block_table(rid)))
                step = self._forward(chunks)
                for i, rid in enumerate(rids):
                    mgr.commit(rid, len(mgr.token_ids(rid)), cache_blocks=self.prefix_caching)
                    outputs[i].append(int(torch.argmax(step[i])))
            decode_s = time.perf_counter() - t0
        finally:
            for rid in rids:
                mgr.free(rid)
        for st in stats:
            st.decode_s = decode_s
        return [GenerationResult(out, lg, st) for out, lg, st in zip(outputs, logits0, stats)]

