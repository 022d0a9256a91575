"""The engine API over the tier stack (`kvstore/block_store.py`) under kvstrata's own chain
keys: whole-block saves and loads for engines with paged KV."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore import ExtraKeys, KVCacheStore, KVLayout, LayoutMismatchError, LoadResult, StoreConfig
from kvstore.errors import InvalidInputError
from tests.conftest import make_kv
from tiers.keys import TierKind

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.uint8)
BLOCK = 4


def _store(
    tmp_path: Path, *, cpu_blocks: int = 16, disk: bool = True, **kw: object
) -> KVCacheStore:
    return KVCacheStore(
        StoreConfig(
            layout=LAYOUT,
            block_size=BLOCK,
            cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK),
            disk_path=str(tmp_path / "disk") if disk else None,
            disk_bytes=8 << 20,
            disk_sync=False,
            **kw,  # type: ignore[arg-type]
        )
    )


def _blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = LAYOUT.block_shape(BLOCK)
    return [torch.randint(0, 255, shape, generator=g, dtype=torch.uint8) for _ in range(n)]


def _empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.block_shape(BLOCK), dtype=torch.uint8) for _ in range(n)]


TOKENS = list(range(100, 100 + 5 * BLOCK + 2))  # five full blocks and a partial one


def _save(store: KVCacheStore, tokens: object, srcs: list[torch.Tensor], first_block: int = 0, **kw: object) -> int:
    """Save `srcs` as blocks `first_block, ...` of `tokens`; the blocks newly written."""
    keys = store.keys(tokens, first_block=first_block, num_blocks=len(srcs), **kw)  # type: ignore[arg-type]
    return store.blocks.save(keys, srcs).num_new


def _load(store: KVCacheStore, tokens: object, dsts: list[torch.Tensor], first_block: int = 0,
          **kw: object) -> LoadResult:
    """Load blocks `first_block, ...` of `tokens` into `dsts`."""
    keys = store.keys(tokens, first_block=first_block, num_blocks=len(dsts), **kw)  # type: ignore[arg-type]
    return store.blocks.load(keys, dsts)


def test_saved_blocks_match_store_and_retrieve(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        blocks = _blocks(5, seed=1)
        assert _save(store, TOKENS, blocks[:2]) == 2
        assert _save(store, TOKENS, blocks[2:], first_block=2) == 3
        assert _save(store, TOKENS, blocks[1:3], first_block=1) == 0  # already held
        assert store.lookup(TOKENS) == 5 * BLOCK
        res = store.retrieve(TOKENS)
        assert torch.equal(res.kv, torch.cat(blocks, dim=2))
        store.check_integrity()


def test_load_copies_from_first_block_and_counts_tiers(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        blocks = _blocks(5, seed=2)
        _save(store, TOKENS, blocks)
        dsts = _empty(3)
        res = _load(store, TOKENS, dsts, first_block=2)
        assert res.num_blocks == 3 and res.blocks_per_tier == {TierKind.CPU: 3}
        assert all(torch.equal(d, b) for d, b in zip(dsts, blocks[2:], strict=True))
        assert _load(store, TOKENS, [], first_block=5).num_blocks == 0
        store.check_integrity()


def test_load_stops_at_first_missing_block(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        blocks = _blocks(5, seed=3)
        _save(store, TOKENS, blocks[:2])
        _save(store, TOKENS, blocks[3:], first_block=3)  # hole at block 2
        dsts = _empty(5)
        assert _load(store, TOKENS, dsts).num_blocks == 2
        assert torch.equal(dsts[2], torch.zeros_like(dsts[2]))  # untouched past the hole
        # Block 3 is addressable on its own: its hash chains the whole prefix.
        assert _load(store, TOKENS, dsts[3:4], first_block=3).num_blocks == 1
        assert torch.equal(dsts[3], blocks[3])
        assert store.lookup(TOKENS) == 2 * BLOCK


def test_other_tokens_miss(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        _save(store, TOKENS, _blocks(5, seed=4))
        other = list(TOKENS)
        other[0] += 1  # changes every chained key
        assert _load(store, other, _empty(5)).num_blocks == 0


def test_write_through_reaches_a_second_process_view_of_the_disk(tmp_path: Path) -> None:
    blocks = _blocks(5, seed=5)
    with _store(tmp_path, write_through=True) as writer, _store(tmp_path, cpu_blocks=0) as reader:
        _save(writer, TOKENS, blocks)
        dsts = _empty(5)
        res = _load(reader, TOKENS, dsts)
        assert res.num_blocks == 5 and res.blocks_per_tier == {TierKind.DISK: 5}
        assert all(torch.equal(d, b) for d, b in zip(dsts, blocks, strict=True))
        writer.check_integrity()
        reader.check_integrity()


def test_disk_hits_are_promoted(tmp_path: Path) -> None:
    blocks = _blocks(5, seed=6)
    with _store(tmp_path) as store:
        _save(store, TOKENS, blocks)
    with _store(tmp_path) as store:  # reopened: CPU tier empty, disk holds everything
        assert _load(store, TOKENS, _empty(5)).blocks_per_tier == {TierKind.DISK: 5}
        assert _load(store, TOKENS, _empty(5)).blocks_per_tier == {TierKind.CPU: 5}
        store.check_integrity()


def test_eviction_demotes_to_disk(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=2) as store:
        blocks = _blocks(5, seed=7)
        _save(store, TOKENS, blocks)
        dsts = _empty(5)
        res = _load(store, TOKENS, dsts)
        assert res.num_blocks == 5 and res.blocks_per_tier.get(TierKind.DISK, 0) >= 3
        assert all(torch.equal(d, b) for d, b in zip(dsts, blocks, strict=True))
        store.check_integrity()


def test_bad_input_raises_and_changes_nothing(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        blocks = _blocks(6, seed=8)
        with pytest.raises(LayoutMismatchError, match="need 24 tokens, got 22"):
            _save(store, TOKENS, blocks)
        with pytest.raises(LayoutMismatchError, match="a block must be a tensor"):
            _save(store, TOKENS, [torch.zeros(3, dtype=torch.uint8)])
        with pytest.raises(LayoutMismatchError, match=r"block dtype is torch\.float32"):
            _save(store, TOKENS, [torch.zeros(LAYOUT.block_shape(BLOCK))])
        with pytest.raises(InvalidInputError, match="first_block must be an int >= 0"):
            _load(store, TOKENS, _empty(1), first_block=-1)
        assert store.lookup(TOKENS) == 0
        assert store.stats().num_blocks_stored == 0


def test_block_chain_hashes_a_growing_sequence_once_with_the_same_keys(make_store: Callable[..., KVCacheStore]) -> None:
    """Redesign: a request is hashed once. A `BlockChain` extended block by block gives the
    keys a fresh hash of the whole prefix gives; a changed sequence is rehashed, and a chain
    of another store or other extra keys is refused."""
    store = make_store()
    tokens = list(range(1000, 1000 + 6 * BLOCK))
    kv = make_kv(len(tokens))
    blocks = [kv[:, :, i * BLOCK : (i + 1) * BLOCK] for i in range(6)]
    chain = store.chain()
    for i in range(6):  # one more block per step, as an engine saves them
        assert _save(store, tokens[: (i + 1) * BLOCK], [blocks[i]], first_block=i, chain=chain) == 1
    assert chain.hashes == store.block_hashes(tokens)
    assert store.lookup(tokens) == 6 * BLOCK
    other = [5, *tokens[1:]]  # same length, another first token: not an extension
    assert _save(store, other, blocks[:1], chain=chain) == 1
    assert chain.hashes[:1] == store.block_hashes(other)[:1]
    with pytest.raises(InvalidInputError, match="chain"):
        _load(store, tokens, [torch.empty_like(blocks[0])], chain=chain, extra_keys=ExtraKeys(cache_salt="x"))
    with pytest.raises(InvalidInputError, match="chain"):
        _load(make_store(namespace="other", disk=False), tokens, [torch.empty_like(blocks[0])], chain=chain)
