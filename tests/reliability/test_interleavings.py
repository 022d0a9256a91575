"""Random interleavings of the public calls against a reference model (hypothesis, stateful).

Two namespaces share one disk directory; each has its own store (pool in front for one of
them), and a forked child process sometimes writes into the directory too. Rules: store,
retrieve with and without `out=`, the engine API's save / load with random (sometimes
aliased) destinations, lookup, scrub, clear, close and reopen. The model is the set of block
keys ever stored and not cleared since; every block's bytes are a pure function of
(namespace, salt, token prefix) (`kvgen.block_bytes`), so the one invariant that matters is
checked on every byte returned: it is the byte stored under that exact (namespace, tokens,
extra keys), and a hit is never for a key the model does not hold.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvstore import ExtraKeys, InvalidInputError, KVCacheStore

from .budget import BUDGET
from .kvgen import BLOCK, LAYOUT, block_bytes, check_kv, make_kv, open_store

NAMESPACES = ("model-a", "model-b")
SALTS = (None, "tenant-1", "tenant-2")
ROOTS = [np.random.default_rng([BUDGET.seed, 90, r]).integers(0, 50_000, size=6 * BLOCK, dtype=np.uint32)
         for r in range(3)]

prompts = st.builds(
    lambda root, blocks, tail: np.concatenate([ROOTS[root][: blocks * BLOCK], np.arange(tail, dtype=np.uint32)]),
    st.integers(0, len(ROOTS) - 1), st.integers(1, 6), st.integers(0, BLOCK + 3),
)


_TOTALS = {"runs": 0, "blocks_checked": 0}


# A query: (namespace, salt, tokens). Most reuse something stored, some with another
# namespace or salt swapped in (an isolation probe), some are fresh.
fresh = st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(SALTS), prompts)


def _variant(entry: tuple[str, str | None, np.ndarray], swap: int) -> tuple[str, str | None, np.ndarray]:
    ns, salt, tokens = entry
    if swap == 1:
        ns = NAMESPACES[(NAMESPACES.index(ns) + 1) % len(NAMESPACES)]
    elif swap == 2:
        salt = SALTS[(SALTS.index(salt) + 1) % len(SALTS)]
    return ns, salt, tokens


def _tag(ns: str, salt: str | None) -> str:
    return f"{ns}/{salt}"


def _keys(salt: str | None) -> ExtraKeys | None:
    return None if salt is None else ExtraKeys(cache_salt=salt)


class StoreModel(RuleBasedStateMachine):
    stored = Bundle("stored")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstrata-interleave-")
        self.stores: dict[str, KVCacheStore] = {}
        self.held: set[tuple[str, str | None, bytes]] = set()  # (ns, salt, prefix bytes) per block
        self.num_checked = 0
        for ns in NAMESPACES:
            self._open(ns)

    def _open(self, ns: str) -> None:
        extra: dict[str, object] = {"pool_blocks": 6, "pool_device": "cpu"} if ns == "model-a" else {}
        self.stores[ns] = open_store(self.dir, namespace=ns, cpu_bytes=8 * LAYOUT.block_bytes(BLOCK),
                                     disk_bytes=8 << 20, **extra)

    def _record(self, ns: str, salt: str | None, tokens: np.ndarray, num_blocks: int, first: int = 0) -> None:
        for i in range(first, first + num_blocks):
            self.held.add((ns, salt, tokens[: (i + 1) * BLOCK].tobytes()))

    def _check_hit(self, ns: str, salt: str | None, tokens: np.ndarray, num_blocks: int, first: int = 0) -> None:
        for i in range(first, first + num_blocks):
            assert (ns, salt, tokens[: (i + 1) * BLOCK].tobytes()) in self.held, \
                f"{ns}/{salt}: block {i} hit although the model never stored it (or it was cleared)"

    # -- rules ------------------------------------------------------------------------------
    @rule(target=stored, entry=fresh)
    def store(self, entry: tuple[str, str | None, np.ndarray]) -> tuple[str, str | None, np.ndarray]:
        ns, salt, tokens = entry
        kv = make_kv(tokens, LAYOUT, BLOCK, _tag(ns, salt))
        self.stores[ns].store(tokens, kv, extra_keys=_keys(salt))
        self._record(ns, salt, tokens, len(tokens) // BLOCK)
        return entry

    @rule(entry=st.one_of(stored, fresh), swap=st.sampled_from([0, 0, 1, 2]),
          out=st.sampled_from(["none", "fresh", "slice"]))
    def retrieve(self, entry: tuple[str, str | None, np.ndarray], swap: int, out: str) -> None:
        ns, salt, tokens = _variant(entry, swap)
        buf = None
        if out != "none":
            big = torch.empty(LAYOUT.block_shape(len(tokens) + 2 * BLOCK), dtype=LAYOUT.dtype)
            buf = big if out == "fresh" else big[:, :, BLOCK:]
        res = self.stores[ns].retrieve(tokens, extra_keys=_keys(salt), out=buf)
        self.num_checked += check_kv(tokens, res.kv, res.num_tokens, LAYOUT, BLOCK, _tag(ns, salt))
        self._check_hit(ns, salt, tokens, res.num_tokens // BLOCK)

    @rule(ns=st.sampled_from(NAMESPACES), salt=st.sampled_from(SALTS), tokens=prompts, first=st.integers(0, 3))
    def save_blocks(self, ns: str, salt: str | None, tokens: np.ndarray, first: int) -> None:
        num_full = len(tokens) // BLOCK
        if first > num_full:
            return
        kv = make_kv(tokens, LAYOUT, BLOCK, _tag(ns, salt))
        srcs = [kv[:, :, i * BLOCK : (i + 1) * BLOCK] for i in range(first, num_full)]
        store = self.stores[ns]
        store.blocks.save(store.keys(tokens, extra_keys=_keys(salt), first_block=first), srcs)
        self._record(ns, salt, tokens, num_full - first, first)

    @rule(entry=st.one_of(stored, fresh), swap=st.sampled_from([0, 0, 1, 2]), first=st.integers(0, 2),
          dests=st.sampled_from(["separate", "one_slab", "aliased", "strided"]))
    def load_blocks(self, entry: tuple[str, str | None, np.ndarray], swap: int, first: int, dests: str) -> None:
        ns, salt, tokens = _variant(entry, swap)
        n = len(tokens) // BLOCK - first
        if n <= 0:
            return
        store = self.stores[ns]
        keys = store.keys(tokens, extra_keys=_keys(salt), first_block=first, num_blocks=n)
        shape = LAYOUT.block_shape(BLOCK)
        if dests == "separate":
            dsts = [torch.empty(shape, dtype=LAYOUT.dtype) for _ in range(n)]
        elif dests == "one_slab":
            slab = torch.empty((n, *shape), dtype=LAYOUT.dtype)
            dsts = list(slab)
        elif dests == "strided":  # disjoint views interleaved in one tensor, as a paged pool's are
            pool = torch.empty((shape[0], 2, n, BLOCK, *shape[3:]), dtype=LAYOUT.dtype)
            dsts = [pool[:, :, i] for i in range(n)]
        else:
            one = torch.empty(shape, dtype=LAYOUT.dtype)
            dsts = [one] * n
            if n > 1:
                with pytest.raises(InvalidInputError):
                    store.blocks.load(keys, dsts)
                return
        got = store.blocks.load(keys, dsts).num_blocks
        for i in range(got):
            want = block_bytes(tokens[: (first + i + 1) * BLOCK], LAYOUT, BLOCK, _tag(ns, salt))
            assert dsts[i].contiguous().view(torch.uint8).numpy().tobytes() == want, f"block {first + i} differs"
        self.num_checked += got
        self._check_hit(ns, salt, tokens, got, first)

    @rule(entry=st.one_of(stored, fresh), swap=st.sampled_from([0, 1, 2]))
    def lookup(self, entry: tuple[str, str | None, np.ndarray], swap: int) -> None:
        ns, salt, tokens = _variant(entry, swap)
        n = self.stores[ns].lookup(tokens, extra_keys=_keys(salt))
        assert n % BLOCK == 0 and n <= len(tokens)
        self._check_hit(ns, salt, tokens, n // BLOCK)

    @rule(ns=st.sampled_from(NAMESPACES))
    def scrub(self, ns: str) -> None:
        result = self.stores[ns].scrub()
        assert result is not None and result.num_corrupt == 0  # nothing here is damaged

    @rule(ns=st.sampled_from(NAMESPACES))
    def clear(self, ns: str) -> None:
        self.stores[ns].clear()
        self.held = {k for k in self.held if k[0] != ns}

    @rule(ns=st.sampled_from(NAMESPACES))
    def reopen(self, ns: str) -> None:
        self.stores[ns].close()
        self._open(ns)

    @precondition(lambda self: hasattr(os, "fork"))
    @rule(salt=st.sampled_from(SALTS), tokens=prompts)
    def child_process_stores(self, salt: str | None, tokens: np.ndarray) -> None:
        pid = os.fork()
        if pid == 0:  # a forked child opens its own store on the shared directory
            code = 1
            try:
                with open_store(self.dir, namespace="model-b", cpu_bytes=0, disk_bytes=8 << 20) as child:
                    child.store(tokens, make_kv(tokens, LAYOUT, BLOCK, _tag("model-b", salt)), extra_keys=_keys(salt))
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert status == 0, "the child's store failed"
        self._record("model-b", salt, tokens, len(tokens) // BLOCK)

    @invariant()
    def integrity(self) -> None:
        for store in self.stores.values():
            store.check_integrity()

    def teardown(self) -> None:
        _TOTALS["runs"] += 1
        _TOTALS["blocks_checked"] += self.num_checked
        for store in self.stores.values():
            store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreModel.TestCase.settings = settings(
    max_examples=BUDGET.hypothesis_examples, stateful_step_count=60, deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestInterleavings = StoreModel.TestCase


def test_interleavings_checked_real_bytes(figures: object) -> None:
    """Runs after TestInterleavings (same module): the runs did check returned bytes."""
    assert _TOTALS["runs"] >= 5 and _TOTALS["blocks_checked"] > 0, _TOTALS
    figures.set("runs", _TOTALS["runs"])  # type: ignore[attr-defined]
    figures.set("blocks_checked", _TOTALS["blocks_checked"])  # type: ignore[attr-defined]
