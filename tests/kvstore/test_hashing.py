"""Chained block hashing: golden vectors, canonical token encoding, extra keys."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
import xxhash

from kvstore import ExtraKeys, InvalidInputError, InvalidTokensError, MultiModalInput
from kvstore.hashing import HASH_FORMAT_VERSION, as_token_array, block_hashes, namespace_seed

TOKENS = list(range(48))

# Pinned digests: changing any of these breaks every on-disk store, so it must be deliberate.
GOLDEN_XXH3 = [
    "cf30d11b673e2f77c7d62000889d6136",
    "0daf7130970fe8af81ecd3e2eebdff9f",
    "43cd05b43850d09e3cf0e995f15d9c9e",
]
GOLDEN_SHA256 = [
    "acdaec375c68db24e33dc6baf7f147b23f693b0ccfb1803f5c37679649568597",
    "af87a266f96c42b3de701b0cf0760aaea6869260cb2be52f25089d6cd1a50499",
    "5fa276b264c82ab06ddca7ffcee56117fc9189f2b127b62420669964c1f57aa7",
]
GOLDEN_EXTRAS = [
    "b2b4572abe92a56977522f969ae0305b",
    "4bfd2ca86f96a99552d34f1cd91bc90a",
    "f2633c0190ac35a6d80ed42dfc83390d",
]
GOLDEN_EXTRA_KEYS = ExtraKeys(cache_salt="tenant-a", lora_id=7, mm_inputs=[("img0", 10, 12)])


def test_golden_vectors_xxh3() -> None:
    got = [h.hex() for h in block_hashes(TOKENS, 16, namespace="golden")]
    assert got == GOLDEN_XXH3


def test_golden_vectors_sha256() -> None:
    got = [h.hex() for h in block_hashes(TOKENS, 16, namespace="golden", algo="sha256")]
    assert got == GOLDEN_SHA256
    assert all(len(bytes.fromhex(h)) == 32 for h in got)


def test_golden_vectors_with_extra_keys() -> None:
    got = block_hashes(TOKENS, 16, namespace="golden", extra_keys=GOLDEN_EXTRA_KEYS)
    assert [h.hex() for h in got] == GOLDEN_EXTRAS


def test_chain_matches_its_specification() -> None:
    """Recompute the chain from the documented formula with raw xxhash."""
    seed = xxhash.xxh3_128_digest(HASH_FORMAT_VERSION + b"golden")
    assert namespace_seed("golden") == seed
    prev = seed
    for i, expected in enumerate(GOLDEN_XXH3):
        block = np.arange(i * 16, (i + 1) * 16, dtype="<u4").tobytes()
        prev = xxhash.xxh3_128_digest(prev + block)
        assert prev.hex() == expected
    prev = hashlib.sha256(HASH_FORMAT_VERSION + b"golden").digest()
    for i, expected in enumerate(GOLDEN_SHA256):
        prev = hashlib.sha256(prev + np.arange(i * 16, (i + 1) * 16, dtype="<u4").tobytes()).digest()
        assert prev.hex() == expected


def test_extras_encoding_matches_its_specification() -> None:
    seed = namespace_seed("golden")
    extras0 = msgpack.packb([["salt", "tenant-a"], ["lora", 7], ["mm", "img0", 10]], use_bin_type=True)
    h0 = xxhash.xxh3_128_digest(seed + np.arange(16, dtype="<u4").tobytes() + extras0)
    extras1 = msgpack.packb([["lora", 7], ["mm", "img0", 10]], use_bin_type=True)  # image spans 10..22
    h1 = xxhash.xxh3_128_digest(h0 + np.arange(16, 32, dtype="<u4").tobytes() + extras1)
    extras2 = msgpack.packb([["lora", 7]], use_bin_type=True)
    h2 = xxhash.xxh3_128_digest(h1 + np.arange(32, 48, dtype="<u4").tobytes() + extras2)
    assert [h0.hex(), h1.hex(), h2.hex()] == GOLDEN_EXTRAS


@pytest.mark.parametrize(
    "tokens",
    [
        TOKENS,
        tuple(TOKENS),
        np.array(TOKENS, dtype=np.int64),
        np.array(TOKENS, dtype=np.int32),
        np.array(TOKENS, dtype=np.uint16),
        np.array(TOKENS, dtype=">i8"),  # big-endian input still hashes as little-endian
        torch.tensor(TOKENS, dtype=torch.int64),
        torch.tensor(TOKENS, dtype=torch.int32),
        torch.tensor([*TOKENS, 0, 0], dtype=torch.int64)[:48],
    ],
    ids=["list", "tuple", "np-int64", "np-int32", "np-uint16", "np-be-int64",
         "torch-int64", "torch-int32", "torch-view"],
)
def test_every_token_container_hashes_alike(tokens: object) -> None:
    assert [h.hex() for h in block_hashes(tokens, 16, namespace="golden")] == GOLDEN_XXH3


def test_hashes_do_not_depend_on_pythonhashseed() -> None:
    code = (
        "from kvstore.hashing import block_hashes;"
        "print(','.join(h.hex() for h in block_hashes(list(range(48)), 16, namespace='golden')))"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert outs == {",".join(GOLDEN_XXH3)}


def test_partial_block_is_ignored_and_prefix_is_stable() -> None:
    full = block_hashes([*TOKENS, 1, 2, 3], 16, namespace="golden")
    assert [h.hex() for h in full] == GOLDEN_XXH3
    assert block_hashes(TOKENS[:15], 16, namespace="golden") == []
    assert block_hashes([], 16, namespace="golden") == []


def test_chaining_makes_position_matter() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16, namespace="ns")
    b = block_hashes([2] * 16, 16, namespace="ns")
    assert a[1] != b[0]  # same block contents, different parent


def test_namespace_separates_everything() -> None:
    assert block_hashes(TOKENS, 16, namespace="m1") != block_hashes(TOKENS, 16, namespace="m2")
    assert set(block_hashes(TOKENS, 16, namespace=["m", 1])).isdisjoint(
        block_hashes(TOKENS, 16, namespace=["m", 2])
    )


def test_cache_salt_changes_every_block() -> None:
    plain = block_hashes(TOKENS, 16, namespace="ns")
    salted = block_hashes(TOKENS, 16, namespace="ns", extra_keys=ExtraKeys(cache_salt="t1"))
    other = block_hashes(TOKENS, 16, namespace="ns", extra_keys=ExtraKeys(cache_salt="t2"))
    assert set(plain).isdisjoint(salted) and set(salted).isdisjoint(other)


def test_multimodal_input_enters_only_overlapping_blocks() -> None:
    img = ExtraKeys(mm_inputs=[MultiModalInput("imgA", 20, 8)])  # tokens 20..27: block 1 only
    img_b = ExtraKeys(mm_inputs=[MultiModalInput("imgB", 20, 8)])
    plain = block_hashes(TOKENS, 16, namespace="ns")
    a = block_hashes(TOKENS, 16, namespace="ns", extra_keys=img)
    b = block_hashes(TOKENS, 16, namespace="ns", extra_keys=img_b)
    assert a[0] == plain[0] == b[0]
    assert a[1] != plain[1] and a[1] != b[1]
    assert a[2] != b[2]  # the chain carries the difference on
    assert ExtraKeys(mm_inputs=[("x", 20, 8)]).block_extras(1, 16) != b""
    assert ExtraKeys(mm_inputs=[("x", 20, 8)]).block_extras(2, 16) == b""


def test_lora_id_enters_every_block() -> None:
    e = ExtraKeys(lora_id=3)
    assert all(e.block_extras(i, 16) for i in range(3))
    assert block_hashes(TOKENS, 16, namespace="ns", extra_keys=e) != block_hashes(
        TOKENS, 16, namespace="ns", extra_keys=ExtraKeys(lora_id=4)
    )


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1.5, 2.0], "integers"),
        (np.array([1.0, 2.0]), "integers"),
        (torch.tensor([1.0]), "integers"),
        ([-1, 2], r"\[0, 2\*\*32\)"),
        ([2**32], r"\[0, 2\*\*32\)"),
        ([2**70], "2\\*\\*32"),
        (np.array([[1, 2]]), "1-D"),
        ("abc", "sequence of ints"),
        (b"abc", "sequence of ints"),
        (None, "sequence of ints"),
        (np.array([True, False]), "integers"),
        (torch.tensor([True]), "integers"),
        (["a", "b"], "integers"),
    ],
)
def test_bad_tokens_raise(tokens: object, message: str) -> None:
    with pytest.raises(InvalidTokensError, match=message):
        block_hashes(tokens, 16, namespace="ns")


def test_bad_arguments_raise() -> None:
    with pytest.raises(InvalidInputError, match="block_size"):
        block_hashes(TOKENS, 0, namespace="ns")
    with pytest.raises(InvalidInputError, match="extra_keys"):
        block_hashes(TOKENS, 16, namespace="ns", extra_keys={"lora_id": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hash_algo"):
        block_hashes(TOKENS, 16, namespace="ns", algo="md5")
    with pytest.raises(InvalidInputError, match="cache_salt"):
        ExtraKeys(cache_salt=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="mm_inputs"):
        ExtraKeys(mm_inputs=[("img", 0)])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="num_tokens"):
        MultiModalInput("img", 0, 0)


def test_as_token_array_is_uint32_little_endian() -> None:
    arr = as_token_array(np.array([1, 2**32 - 1], dtype=np.uint64))
    assert arr.dtype == np.dtype("<u4") and arr.flags.c_contiguous
    assert arr.tobytes() == b"\x01\x00\x00\x00\xff\xff\xff\xff"


def test_block_chain_extend_hashes_each_new_block_once_and_matches_the_whole_chain() -> None:
    """`BlockChain.extend` appends the keys of the blocks that follow, equal to hashing the
    whole sequence at once; a partial block is refused, nothing is hashed twice."""
    from kvstore.config import HashAlgo
    from kvstore.hashing import BlockChain, as_token_array, namespace_seed

    tokens = as_token_array(list(range(1000, 1040)))
    extra = ExtraKeys(cache_salt="t", lora_id=3)
    seed = namespace_seed("ns")
    chain = BlockChain(seed, 8, HashAlgo.XXH3_128, extra)
    chain.extend(tokens[:16])
    got = chain.extend(tokens[16:40])
    assert got == block_hashes(tokens, 8, namespace="ns", extra_keys=extra)
    assert chain.hashes_of(tokens) == got  # the same sequence: nothing rehashed, same keys
    with pytest.raises(InvalidInputError, match="whole blocks of 8"):
        chain.extend(tokens[:5])
    assert len(chain.hashes) == 5
