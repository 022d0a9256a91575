"""The connector's worker role: whole-block byte copies between vLLM's paged KV and the store,
as the scheduler's plan says. Each request's block keys are hashed once and extended as its
blocks complete (one `BlockChain` per request and direction).

Loads of hits held in memory are synchronous (before the forward pass). With `async_loads`
(the default) a hit that reads disk or a remote tier is loaded by a background thread while
vLLM keeps the request waiting outside its steps (`WAITING_FOR_REMOTE_KVS`); `get_finished`
reports the load's end, blocks it could not load go to `get_block_ids_with_load_errors`
before that (vLLM recomputes them). A request aborted meanwhile keeps its blocks until its
load has ended. Saves, with `async_saves` (the default),
leave the forward path: the step copies the blocks out of vLLM's KV into a staging buffer of
their own (so vLLM may reuse its blocks at once: `request_finished` never delays a free), and
one background thread writes them to the tiers, in order. A lookup in this process that
misses a block still queued waits for that write (`PENDING`), so a request repeated at once
still hits.

Sleep (vLLM's sleep mode: `unregister_kv_caches` / `restore_kv_caches`): vLLM's KV memory
goes away and comes back at the same addresses with other contents. Asleep, the worker holds
no view of it: no copy reads or writes it (a background load still running then fills
nothing: its blocks are load errors), and a step's loads and saves are skipped and counted
(`sleep_skipped_blocks`; skipped loads are blocks vLLM recomputes). Restored, the views are
rebuilt from the registered tensors.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from engine_adapter.vllm.forward_timer import ForwardTimer
from engine_adapter.vllm.paged_blocks import PagedKVBlocks
from engine_adapter.vllm.policy_rates import TierShares, WorkerRates, worker_rates
from engine_adapter.vllm.stats import ConnectorStats
from engine_adapter.vllm.transfer_plan import BlockTransfer, StepPlan
from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError, DiskFullError
from kvstore.hashing import BlockChain
from kvstore.keying import key_hashes
from tiers.keys import BlockKey

logger = logging.getLogger(__name__)


class PendingSaves:
    """Blocks queued for writing in this process, by store: a lookup that misses a block still
    on its way waits for it (read-your-writes), and only then."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._blocks: dict[int, dict[bytes, int]] = {}  # id(store) -> block hash -> saves queued

    def add(self, store: KVCacheStore, hashes: Sequence[bytes]) -> None:
        with self._cond:
            held = self._blocks.setdefault(id(store), {})
            for h in hashes:
                held[h] = held.get(h, 0) + 1

    def done(self, store: KVCacheStore, hashes: Sequence[bytes]) -> None:
        with self._cond:
            held = self._blocks.get(id(store), {})
            for h in hashes:
                left = held.get(h, 0) - 1
                if left > 0:
                    held[h] = left
                else:
                    held.pop(h, None)
            self._cond.notify_all()

    def any(self, store: KVCacheStore) -> bool:
        """Whether any block is queued for `store` (cheap: no hashing needed otherwise)."""
        return bool(self._blocks.get(id(store)))

    def wait_for(self, store: KVCacheStore, block_hash: bytes, timeout_s: float = 5.0) -> bool:
        """Wait until `block_hash` is no longer queued for `store`; True if it was queued."""
        with self._cond:
            held = self._blocks.get(id(store), {})
            if block_hash not in held:
                return False
            self._cond.wait_for(lambda: block_hash not in held, timeout_s)
            return True


PENDING = PendingSaves()


class ConnectorWorker:
    """Copies the blocks a step's plan names, in and out of vLLM's paged KV tensors."""

    def __init__(self, store: KVCacheStore, config: StoreConfig, layer_names: list[str], num_blocks: int,
                 stats: ConnectorStats, *, async_saves: bool = True, verify_tolerance: float = 0.0) -> None:
        self.store = store
        self.verify_tolerance = verify_tolerance
        self.config = config
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.stats = stats
        self.paged: PagedKVBlocks | None = None
        self._registered: dict[str, torch.Tensor] = {}  # this worker's layers, as vLLM registered them
        self._asleep = False
        self._views_lock = threading.Lock()  # held by every copy into vLLM's blocks and by sleep
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load left blocks unloaded
        self._chains: dict[str, BlockChain] = {}  # loads (this thread)
        # Saves: on the writer thread when asynchronous (with chains of their own).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-save") if async_saves else None
        # Background loads: one thread; vLLM learns of each through get_finished.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-load")
        self._load_lock = threading.Lock()
        self._loads_running: set[str] = set()
        self._loads_done: set[str] = set()  # to report as finished_recving
        self._delayed: set[str] = set()  # frees vLLM waits for: reported once their load ended
        self._told_finished: set[str] = set()  # requests vLLM said finished (get_finished)
        self.timer = ForwardTimer()  # the forward pass of each step, for the load policy
        self.tier_shares = TierShares()  # the blocks each tier served recently (policy_rates.py)
        # Asynchronous saves: this thread's chains; each job takes a copy of the keys it needs.
        self._save_chains: dict[str, BlockChain] = {}

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
        with self._views_lock:
            self.paged, self._asleep = paged, False
            self._registered = {n: kv_caches[n] for n in self.layer_names}
        self.timer = ForwardTimer(kv_caches[self.layer_names[0]].device)

    def unregister_kv_caches(self) -> None:
        """vLLM is about to free its KV memory (sleep): drop every view of it; from now on no
        copy touches it until `restore_kv_caches`. Waits for a copy in progress; idempotent."""
        with self._views_lock:
            paged, self.paged, self._asleep = self.paged, None, bool(self._registered)
        if paged is not None and paged.device.type != "cpu":  # copies queued on the device land first
            torch.accelerator.synchronize(paged.device)

    def restore_kv_caches(self) -> None:
        """vLLM's KV memory is back (wake-up): rebuild the views from the registered tensors.
        Idempotent; nothing to do if never unregistered."""
        with self._views_lock:
            if not self._asleep:
                return
        self.register_kv_caches(self._registered)

    @property
    def asleep(self) -> bool:
        return self._asleep

    def _skip_asleep(self, transfers: Sequence[BlockTransfer], errors: bool) -> bool:
        """While asleep: count `transfers` as skipped (as load errors too, if `errors`) and say
        True; else False."""
        if not self._asleep:
            return False
        n = sum(len(t.block_ids) for t in transfers)
        if n:
            self.stats.count("sleep_skipped_blocks", n)
            if errors:
                with self._load_lock:
                    for t in transfers:
                        self._load_errors.update(t.block_ids)
                        self._failed_loads.add(t.req_id)
        return True

    def _paged(self) -> PagedKVBlocks:
        if self.paged is None:
            raise RuntimeError("kvstrata: transfer before register_kv_caches (a bug)")
        return self.paged

    def _chain(self, transfer: BlockTransfer, chains: dict[str, BlockChain] | None = None) -> BlockChain:
        chains = self._chains if chains is None else chains
        chain = chains.get(transfer.req_id)
        if chain is None or chain.extra_keys != transfer.extra_keys:
            chain = chains[transfer.req_id] = self.store.chain(transfer.extra_keys)
        return chain

    def load(self, plan: StepPlan) -> None:
        """Copy this step's store hits into vLLM's blocks (before the forward pass), and start
        the plan's background loads."""
        for req_id in plan.finished:
            self._chains.pop(req_id, None)
        with self._load_lock:
            self._delayed.update(plan.delayed_frees)
            for load in plan.async_loads:
                self._loads_running.add(load.req_id)
        for load in plan.async_loads:
            self._loader.submit(self._load_job, load)
        if self._skip_asleep(plan.loads, errors=True):
            return
        with self.timer.loading():
            for load in plan.loads:
                self._load_one(load, self._chain(load))
        if plan.loads:
            self.stats.write()

    def _load_one(self, load: BlockTransfer, chain: BlockChain | None) -> None:
        with self._views_lock:
            paged = self.paged
        if paged is None and self._skip_asleep([load], errors=True):
            return
        paged = self._paged() if paged is None else paged
        bs = self.config.block_size
        n = len(load.block_ids)
        if n == 0:  # nothing of this group to load (its blocks are vLLM's own already)
            return
        staging = paged.staging(n)
        keys = self.store.keys(load.token_ids, extra_keys=load.extra_keys, chain=chain, first_block=load.first_block,
                               num_blocks=n)
        result = self.store.blocks.load(keys, list(staging))
        with self._views_lock:
            current = self.paged  # vLLM's memory may have gone away meanwhile (sleep): then nothing is written
            if current is None:
                self._skip_asleep([load], errors=True)
                return
            current.scatter(staging, load.block_ids[: result.num_blocks])
        self.tier_shares.add(result.blocks_per_tier)
        for tier, count in result.blocks_per_tier.items():
            self.stats.count(f"load_tokens_{tier.value}", count * bs)
        if result.num_blocks < n:  # evicted since the lookup: vLLM recomputes these
            with self._load_lock:
                self._load_errors.update(load.block_ids[result.num_blocks :])
                self._failed_loads.add(load.req_id)
            self.stats.count("load_error_blocks", n - result.num_blocks)

    def _load_job(self, load: BlockTransfer) -> None:
        try:
            self._load_one(load, None)
        except Exception as exc:  # a fault is blocks to recompute, never a hang
            logger.warning("kvstrata: background load of %s failed: %s: %s", load.req_id, type(exc).__name__, exc)
            with self._load_lock:
                self._load_errors.update(load.block_ids)
                self._failed_loads.add(load.req_id)
            self.stats.count("load_error_blocks", len(load.block_ids))
        finally:
            with self._load_lock:
                self._loads_running.discard(load.req_id)
                self._loads_done.add(load.req_id)
            self.stats.write()

    def wait_for_loads(self, timeout_s: float = 10.0) -> None:
        """Block until the background loads queued so far have ended (`TimeoutError` after
        `timeout_s`); changes nothing else."""
        self._loader.submit(lambda: None).result(timeout=timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(delayed frees that may happen now, background loads that ended). A delayed free
        is reported once vLLM has named the request finished and its load has ended."""
        with self._load_lock:
            self._told_finished |= finished_req_ids & self._delayed
            sending = {r for r in self._told_finished if r not in self._loads_running}
            self._told_finished -= sending
            self._delayed -= sending
            recving, self._loads_done = self._loads_done, set()
        return sending or None, recving or None

    def save(self, plan: StepPlan) -> None:
        """Copy this step's newly completed full blocks out of vLLM (now, in the step) and into
        the store (in the background with `async_saves`, else now)."""
        self._time_forward(plan)
        for req_id in plan.finished:
            self._save_chains.pop(req_id, None)
        if not plan.saves or self._skip_asleep(plan.saves, errors=False):
            return
        paged = self._paged()
        for save in plan.saves:
            staging = paged.staging(len(save.block_ids))  # the job's own buffer
            paged.gather(save.block_ids, staging)
            if self._writer is None:
                self._write(save, staging, self._keys(save, self._chain(save)))
                continue
            # Hashed once, here: the job gets the keys (built on its thread) and names its
            # blocks as queued with their hashes.
            keys = self._keys(save, self._chain(save, self._save_chains))
            hashes = key_hashes(keys)
            PENDING.add(self.store, hashes)
            self._writer.submit(self._write_job, save, staging, keys, hashes)
        if self._writer is None:
            self.stats.write()

    # The load policy's prefill rate: each step's forward pass against its prefill tokens
    # (forward_timer.py says where vLLM runs the forward pass between the connector's hooks).
    def step_begins(self) -> None:
        """vLLM bound this step's metadata: its forward pass is about to run."""
        self.timer.begin()

    def forward_ended(self) -> None:
        """vLLM's forward pass of this step has ended (`finish_forward`)."""
        self.timer.end()

    def _time_forward(self, plan: StepPlan) -> None:
        prefilled = plan.num_prefill_tokens if plan.num_prefill_tokens >= self.config.block_size else 0
        self.timer.finish(prefilled)
        policy = self.store.load_policy
        for num_tokens, seconds in self.timer.samples():
            accepted = policy.observe_prefill(num_tokens, seconds)
            self.stats.count("prefill_samples" if accepted else "prefill_samples_rejected", 1)

    def rates(self, pp_rank: int, tp_rank: int) -> WorkerRates:
        """This worker's load-policy estimates, for a scheduler in another process."""
        return worker_rates(self.store.load_policy, self.tier_shares, pp_rank, tp_rank)

    def _write_job(self, save: BlockTransfer, staging: torch.Tensor, keys: Sequence[BlockKey],
                   hashes: Sequence[bytes]) -> None:
        try:
            self._write(save, staging, keys)
        except Exception as exc:  # a background fault is a lost save (a later miss), never a hang
            logger.warning("kvstrata: background save of %s failed: %s: %s", save.req_id, type(exc).__name__, exc)
            self.stats.count("save_failed_blocks", len(save.block_ids))
        finally:
            PENDING.done(self.store, hashes)
            self.stats.write()

    def _keys(self, save: BlockTransfer, chain: BlockChain) -> Sequence[BlockKey]:
        """The keys of the blocks `save` copies, hashed through `chain`."""
        return self.store.keys(save.token_ids, extra_keys=save.extra_keys, chain=chain, first_block=save.first_block,
                               num_blocks=len(save.block_ids))

    def _write(self, save: BlockTransfer, staging: torch.Tensor, keys: Sequence[BlockKey]) -> None:
        if save.verify:  # KV just computed for a hit: every tier's copy must be within the bound of it
            checked = self.store.blocks.verify(keys, list(staging), tolerance=self.verify_tolerance)
            self.stats.count("verify_checked_blocks", checked.num_checked)
            self.stats.count("verify_mismatch_blocks", sum(len(i) for i in checked.mismatches.values()))
            for kind, check in checked.tiers.items():  # per tier: blocks, mismatches (bound and error: the store's)
                self.stats.count(f"verify_tier_checked_blocks_{kind.value}", check.num_checked)
                self.stats.count(f"verify_tier_mismatch_blocks_{kind.value}", len(check.mismatches))
        try:
            written = self.store.blocks.save(keys, list(staging)).num_new
        except DiskFullError as exc:  # a cache: a refused write is a later miss
            logger.warning("kvstrata: save refused: %s", exc)
            self.stats.count("save_refused_blocks", len(save.block_ids))
            return
        self.stats.count("save_blocks", len(save.block_ids))
        self.stats.count("save_new_blocks", written)
        self.stats.count("save_new_bytes", written * self.config.block_bytes)
        if save.retain_s is not None:  # the request's hint: keep them through eviction pressure
            kept = self.store.blocks.retain(keys, save.retain_s)
            self.stats.count("retained_blocks", kept.num_retained)
            self.stats.count("retain_clipped_blocks", kept.num_clipped)
        if save.priority is not None:  # the request's hint: its blocks' place in eviction order
            done = self.store.blocks.prioritize(keys, save.priority)
            self.stats.count("prioritized_blocks", done.num_applied)
            self.stats.count("priority_clipped_blocks", done.num_clipped)

    def flush(self) -> None:
        """Wait until every background load has ended and every queued save is written
        (shutdown)."""
        self._loader.shutdown(wait=True)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def take_load_errors(self) -> set[int]:
        with self._load_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose load (since the last call) left some of their blocks unloaded."""
        with self._load_lock:
            failed, self._failed_loads = self._failed_loads, set()
        return failed
