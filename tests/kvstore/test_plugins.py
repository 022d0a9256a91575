"""Components from outside kvstrata, used through config alone.

The test writes a module outside the packages (into a temporary directory on `sys.path`) that
defines and registers a tier, an eviction policy and two codecs, each with its config, the way
a user's package would. A store is then configured only with plain dicts naming them by
`type` and `module_path`; nothing in kvstrata is edited, patched or reached by a private name
(the tier implements the protocol's hooks, `_get_into`, `_put` and `_check_open`, as every
tier does). The store demotes into the tier and finds blocks there, the policy chooses the CPU
tier's victims, the codecs write and read the disk tier's blocks, and a lossy codec enters
the store's identity as kvstrata's own do.
"""

from __future__ import annotations

import importlib
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVCacheStore, StoreConfig
from tests.conftest import BLOCK, LAYOUT

BLOCK_BYTES = LAYOUT.block_bytes(BLOCK)

PLUGIN = '''
"""A tier, an eviction policy and codecs of a package outside kvstrata."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tiers.base import BlockHash, BlockKey, Occupancy, Tier, TierCounters, TierKind, TierTraits, count_held
from tiers.codecs import Codec, CodecConfig, CodecKind, register_codec
from tiers.errors import ConfigError, CorruptRecordError, StoreClosedError
from tiers.policies.eviction import EvictionConfig, EvictionPolicy, register_eviction
from tiers.tier_config import TierConfig, TierContext, register_tier

USES = {"pops": 0, "encoded": 0, "decoded": 0}


class ShelfTier(Tier):
    """Block copies in a dict, oldest dropped first."""

    kind = TierKind("shelf")
    traits = TierTraits()

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.blocks: OrderedDict[BlockHash, tuple[BlockKey, torch.Tensor]] = OrderedDict()
        self.capacity, self.block_bytes, self.closed = capacity, block_bytes, False
        self.counters = TierCounters()

    @property
    def capacity_blocks(self) -> int:
        return self.capacity

    def __len__(self) -> int:
        return len(self.blocks)

    def match_prefix(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        self._check_open()
        return count_held(self.blocks, block_hashes, start)

    def held_hashes(self) -> Iterator[BlockHash]:
        return iter(list(self.blocks))

    def _get_into(self, keys: Sequence[BlockKey], dsts: Sequence[torch.Tensor]) -> int:
        n = 0
        for key, dst in zip(keys, dsts):
            held = self.blocks.get(key.block_hash)
            if held is None or (key.tokens and held[0].tokens != key.tokens):
                break
            dst.copy_(held[1])
            n += 1
        return n

    def _put(self, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> int:
        new = [(k, s) for k, s in zip(keys, srcs) if k.block_hash not in self.blocks]
        cut = max(0, len(new) - self.capacity)  # what cannot fit goes below at once
        if cut and self.below is not None:
            self.below.demote([k for k, _ in new[:cut]], [s for _, s in new[:cut]])
        new = new[cut:]
        while self.blocks and len(self.blocks) + len(new) > self.capacity:
            _, (gone, block) = self.blocks.popitem(last=False)
            self.counters.num_evictions += 1
            if self.below is not None:  # the stack's view of the tier below: it takes what falls out
                self.below.demote([gone], [block])
        for key, src in new:
            self.blocks[key.block_hash] = (key, src.detach().to("cpu", copy=True))
        return len(new)

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("shelf tier is closed")

    def occupancy(self) -> Occupancy:
        n = len(self.blocks)
        return Occupancy(n, self.capacity, n * self.block_bytes, self.capacity * self.block_bytes)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        return sum(self.blocks.pop(h, None) is not None for h in block_hashes)

    def clear(self, *, all_namespaces: bool = False) -> None:
        self.blocks.clear()

    def close(self) -> None:
        self.closed = True
        self.blocks.clear()

    def check_integrity(self) -> None:
        if len(self.blocks) > self.capacity:
            raise RuntimeError("shelf over capacity (a bug)")


@register_tier("shelf")
@dataclass(frozen=True)
class ShelfConfig(TierConfig):
    tier = ShelfTier

    capacity_blocks: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_blocks, int) or self.capacity_blocks < 1:
            raise ConfigError(f"ShelfConfig.capacity_blocks must be an int > 0, got {self.capacity_blocks!r}")

    def open(self, ctx: TierContext) -> Tier:
        return ShelfTier(self.capacity_blocks, ctx.block_bytes)


class MRUPolicy(EvictionPolicy[BlockHash]):
    """Most recently used first (a policy LRU's opposite, easy to tell apart)."""

    counts_uses = False

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.keys: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def insert(self, key: BlockHash) -> None:
        self.keys[key] = None

    def access(self, key: BlockHash) -> None:
        self.keys.move_to_end(key)

    refresh = access

    def remove(self, key: BlockHash) -> None:
        del self.keys[key]

    def pop(self) -> BlockHash:
        if not self.keys:
            raise IndexError("pop from an empty MRU policy")
        USES["pops"] += 1
        return self.keys.popitem(last=True)[0]

    def restore(self, key: BlockHash) -> None:
        self.keys[key] = None

    def order(self) -> Iterator[BlockHash]:
        return reversed(list(self.keys))

    def clear(self) -> None:
        self.keys.clear()

    def check_integrity(self) -> None:
        return None


@register_eviction("mru")
@dataclass(frozen=True)
class MRUConfig(EvictionConfig):
    def make(self, capacity_blocks: int) -> EvictionPolicy[BlockHash]:
        return MRUPolicy(capacity_blocks)


ZLIB = CodecKind.define("zlib_block", 230, lossy=False)
ZLIB_HALF = CodecKind.define("zlib_half", 231, lossy=True)


class ZlibCodec(Codec):
    """The block's bytes through zlib; `half` first zeroes each element's low byte (lossy)."""

    def __init__(self, kind: CodecKind, block_shape: tuple[int, ...], dtype: torch.dtype, *, level: int,
                 element_dtype: torch.dtype | None = None, group: int | None = None) -> None:
        super().__init__(block_shape, dtype, element_dtype=element_dtype, group=group)
        self.kind, self.level = kind, level

    def encode(self, src: torch.Tensor) -> bytes:
        USES["encoded"] += 1
        raw = src.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1, src.element_size()).clone()
        if self.kind is ZLIB_HALF:
            raw[:, 0] = 0
        return zlib.compress(raw.numpy().tobytes(), self.level)

    def decode(self, payload: memoryview | bytes | bytearray, dst: torch.Tensor) -> None:
        USES["decoded"] += 1
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(bytes(payload), self.block_bytes + 1)
        except zlib.error as exc:
            raise CorruptRecordError(f"zlib payload does not decode: {exc}") from None
        if len(raw) != self.block_bytes or not inflater.eof:
            raise CorruptRecordError("zlib payload is not one block")
        block = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        dst.copy_(block)


@register_codec("zlib_block")
@dataclass(frozen=True)
class ZlibConfig(CodecConfig):
    kind = ZLIB

    level: int = 6

    def build(self, block_shape: tuple[int, ...], dtype: torch.dtype, *, element_dtype: torch.dtype | None = None,
              group: int | None = None) -> Codec:
        return ZlibCodec(self.kind, block_shape, dtype, level=self.level, element_dtype=element_dtype, group=group)


@register_codec("zlib_half")
@dataclass(frozen=True)
class ZlibHalfConfig(ZlibConfig):
    kind = ZLIB_HALF
'''

MODULE = "kvstrata_test_plugin_outside"


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The module outside the packages, on `sys.path`; imported by the configs that name it."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(folder))
    yield lambda: importlib.import_module(MODULE)  # the module's counters, after a config imported it


def compressible_kv(num_tokens: int, seed: int) -> torch.Tensor:
    """KV of small integers in the layout's dtype: every block shrinks through zlib."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, LAYOUT.block_shape(num_tokens), generator=g).to(LAYOUT.dtype)


def plugin_tiers(disk: Path, codec: str = "zlib_block") -> list[dict[str, Any]]:
    """The store's tiers as plain JSON: kvstrata's CPU tier under the plugin's policy, the
    plugin's tier, kvstrata's disk tier under the plugin's codec."""
    return json.loads(json.dumps([
        {"type": "cpu", "capacity_bytes": 4 * BLOCK_BYTES, "eviction": {"type": "MRUConfig", "module_path": MODULE}},
        {"type": "ShelfTier", "module_path": MODULE, "capacity_blocks": 4},
        {"type": "disk", "path": str(disk), "capacity_bytes": 64 << 20, "sync": "none",
         "codec": {"type": codec, "module_path": MODULE, "level": 9}},
    ]))


def test_a_tier_a_policy_and_a_codec_from_outside_through_config_only(plugin: Any, tmp_path: Path) -> None:
    config = StoreConfig(LAYOUT, block_size=BLOCK, tiers=plugin_tiers(tmp_path / "disk"), load_policy="always")
    uses = plugin().USES
    with KVCacheStore(config) as store:
        assert [t.kind.value for t in store.tiers] == ["cpu", "shelf", "disk"]
        prompts = [list(range(1000 * i, 1000 * i + 2 * BLOCK)) for i in range(8)]
        kvs = [compressible_kv(2 * BLOCK, seed=i) for i in range(8)]
        for p, kv in zip(prompts[:3], kvs[:3]):  # six blocks through a CPU tier of four
            store.store(p, kv)
        # The policy picked the victims: most recently used first, the second prompt left for
        # the shelf tier and the first stayed (least recently used first, the first would go).
        assert uses["pops"] > 0
        assert [store.locate(p) for p in prompts[:3]] == [["cpu"] * 2, ["shelf"] * 2, ["cpu"] * 2]
        for p, kv in zip(prompts[3:], kvs[3:]):
            store.store(p, kv)
        located = [kind for p in prompts for kind in store.locate(p)]
        assert located.count("cpu") == 4 and located.count("shelf") == 4 and located.count("disk") == 8
        # The shelf demoted its oldest blocks to the disk, which wrote them through the codec.
        disk = store.tiers[2]
        codec_ids = {disk.payload_location(h).codec_id for h in disk.held_hashes()}  # type: ignore[attr-defined]
        assert codec_ids == {230} and uses["encoded"] >= 8
        for p, kv in zip(prompts, kvs):
            res = store.retrieve(p)
            assert res.num_tokens == len(p) and torch.equal(res.kv, kv)
        assert uses["decoded"] >= 8
        store.check_integrity()
    # Reopened, the disk tier reads what the plugin's codec wrote (the blocks spilled on close
    # and those the shelf had demoted; the shelf's own are gone with the process). A lossless
    # codec: the store's identity is an exact store's, and so is its namespace.
    exact = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * BLOCK_BYTES, disk_path=str(tmp_path / "disk"))
    assert exact.identity() == config.identity()
    decoded = uses["decoded"]
    with KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, tiers=plugin_tiers(tmp_path / "disk"))) as again:
        found = 0
        for p, kv in zip(prompts, kvs):
            res = again.retrieve(p)
            found += res.num_tokens
            assert res.num_tokens == 0 or torch.equal(res.kv, kv[:, :, : res.num_tokens])
        assert found >= 6 * BLOCK and uses["decoded"] > decoded


def test_a_lossy_codec_from_outside_enters_the_identity(plugin: Any, tmp_path: Path) -> None:
    lossy = StoreConfig(LAYOUT, block_size=BLOCK, tiers=plugin_tiers(tmp_path / "disk", "zlib_half"))
    assert lossy.lossy_codecs == ["zlib_half"] and lossy.identity()[-1] == ["lossy", ["zlib_half"], None, None]
    tokens = list(range(12 * BLOCK))
    kv = compressible_kv(len(tokens), 3)
    with KVCacheStore(lossy) as store:
        store.store(tokens, kv)
        assert "disk" in store.locate(tokens)
        assert store.retrieve(tokens).num_tokens == len(tokens)
    # An exact store over the same disk shares no key with it: none of its blocks is a hit.
    exact = StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=64 * BLOCK_BYTES, disk_path=str(tmp_path / "disk"),
                        disk_sync=False)
    with KVCacheStore(exact) as store:
        assert store.lookup(tokens) == 0


def test_decoded_copies_of_a_lossy_codec_with_no_bound_are_left_unverified_in_every_tier(
        plugin: Any, tmp_path: Path) -> None:
    """A lossy codec from outside that states no `error_bound`: blocks decoded from it and
    promoted into the CPU tier hold its values too, so no tier's copy is compared (a false
    alarm would remove right blocks); they are counted unverified and stay."""
    tiers = plugin_tiers(tmp_path / "disk", "zlib_half")
    lossy = StoreConfig(LAYOUT, block_size=BLOCK, tiers=[{"type": "cpu", "capacity_bytes": 4 * BLOCK_BYTES}, tiers[2]])
    tokens = list(range(2 * BLOCK))
    kv = (compressible_kv(len(tokens), 4) + 1 / 3).to(LAYOUT.dtype)  # low bytes the codec zeroes
    with KVCacheStore(lossy) as store:
        store.store(tokens, kv)
    with KVCacheStore(lossy) as store:  # the disk holds them (spilled on close); the CPU tier is empty
        assert store.locate(tokens) == ["disk"] * 2
        got = store.retrieve(tokens)
        assert got.num_tokens == len(tokens) and not torch.equal(got.kv, kv)  # lossy values
        assert "cpu" in store.locate(tokens)  # promoted: the CPU tier holds the decoded values
        result = store.verify(tokens, kv)
        assert result.ok and result.num_quarantined == 0 and result.num_checked == 0
        assert result.num_unverified >= 2
        assert store.lookup(tokens) == len(tokens)


def test_a_bad_plugin_config_is_one_error_naming_it(plugin: Any, tmp_path: Path) -> None:
    tiers = plugin_tiers(tmp_path / "disk")
    tiers[1]["capacity_blocks"] = 0
    with pytest.raises(ValueError, match=r"^StoreConfig\.tiers\[1\]: ShelfConfig\.capacity_blocks must be an int > 0"):
        StoreConfig(LAYOUT, block_size=BLOCK, tiers=tiers)
    tiers = plugin_tiers(tmp_path / "disk")
    tiers[0]["eviction"]["module_path"] = "kvstrata_no_such_plugin"
    with pytest.raises(ValueError, match=r"^StoreConfig\.tiers\[0\]: CPUTierConfig\.eviction\.module_path="
                                         r"'kvstrata_no_such_plugin' cannot be imported"):
        StoreConfig(LAYOUT, block_size=BLOCK, tiers=tiers)
    tiers = plugin_tiers(tmp_path / "disk")
    tiers[2]["codec"]["levels"] = 3
    with pytest.raises(ValueError, match=r"codec 'zlib_block' has no field 'levels' \(given 3\); its fields: "
                                         r"\['level'\]"):
        StoreConfig(LAYOUT, block_size=BLOCK, tiers=tiers)
