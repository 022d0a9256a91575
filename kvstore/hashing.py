"""Pure, deterministic chained block hashing.

h_0 = H(seed(namespace) || tokens_0 || extras_0) and h_i = H(h_{i-1} || tokens_i || extras_i),
over full blocks only. Tokens are encoded as little-endian uint32 whatever they arrive as;
extras are canonical msgpack, appended only when a block has any (the token part has a
fixed length, so the encoding is unambiguous). Nothing depends on Python's `hash()`,
`PYTHONHASHSEED`, the platform's integer width or the process: golden vectors in
`tests/kvstore/test_hashing.py` pin the digests.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import msgpack
import numpy as np
import torch
import xxhash

from kvstore.config import HashAlgo, parse_hash_algo, require_int
from kvstore.errors import InvalidInputError, InvalidTokensError
from tiers.keys import BlockHash as BlockHash

HASH_FORMAT_VERSION = b"kvstrata.blockhash.v1\x00"
ENGINE_KEY_VERSION = b"kvstrata.enginekey.v1\x00"  # domain of keys an engine names blocks by
MAX_ENGINE_KEY_BYTES = 4096
_TOKEN_MAX = 2**32
_U32_TYPECODE = "I" if array.array("I").itemsize == 4 else "L"


def _check_utf8(owner: str, value: object) -> None:
    """Strings enter keys as UTF-8: one that cannot be encoded (a lone surrogate) is invalid."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(f"{owner} is not valid UTF-8 text: {exc}") from None


@dataclass(frozen=True)
class MultiModalInput:
    """A multimodal input occupying `num_tokens` placeholder tokens from `token_offset`.

    Its `content_hash` enters the key of every block the span overlaps.
    """

    content_hash: str | bytes
    token_offset: int
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.content_hash, (str, bytes)) or not self.content_hash:
            raise InvalidInputError(
                f"MultiModalInput.content_hash must be non-empty str or bytes, got {self.content_hash!r}"
            )
        _check_utf8("MultiModalInput.content_hash", self.content_hash)
        for name in ("token_offset", "num_tokens"):
            value = getattr(self, name)
            require_int(f"MultiModalInput.{name}", value, 0, InvalidInputError)
        if self.num_tokens == 0:
            raise InvalidInputError("MultiModalInput.num_tokens must be > 0")


@dataclass(frozen=True)
class ExtraKeys:
    """Values besides the tokens that make a block's KV distinct.

    Attributes:
        cache_salt: isolates tenants; mixed into the first block, hence into every key.
        lora_id: the adapter the KV was computed with; mixed into every block.
        mm_inputs: multimodal inputs as `MultiModalInput` or `(content_hash, token_offset,
            num_tokens)` tuples; each enters every block it overlaps.
    """

    cache_salt: str | bytes | None = None
    lora_id: int | str | None = None
    mm_inputs: tuple[MultiModalInput, ...] = ()

    def __post_init__(self) -> None:
        if self.cache_salt is not None and not isinstance(self.cache_salt, (str, bytes)):
            raise InvalidInputError(f"ExtraKeys.cache_salt must be str or bytes, got {self.cache_salt!r}")
        if self.lora_id is not None and (
            isinstance(self.lora_id, bool) or not isinstance(self.lora_id, (int, str))
        ):
            raise InvalidInputError(f"ExtraKeys.lora_id must be int or str, got {self.lora_id!r}")
        if isinstance(self.lora_id, int) and not -(2**63) <= self.lora_id < 2**64:
            raise InvalidInputError(f"ExtraKeys.lora_id {self.lora_id} does not fit 64 bits")
        _check_utf8("ExtraKeys.cache_salt", self.cache_salt)
        _check_utf8("ExtraKeys.lora_id", self.lora_id)
        if isinstance(self.mm_inputs, (str, bytes)) or not isinstance(self.mm_inputs, Sequence):
            raise InvalidInputError(f"ExtraKeys.mm_inputs must be a sequence, got {self.mm_inputs!r}")
        items = []
        for item in self.mm_inputs:
            if isinstance(item, MultiModalInput):
                items.append(item)
            elif isinstance(item, Sequence) and len(item) == 3:
                items.append(MultiModalInput(*item))
            else:
                raise InvalidInputError(
                    f"ExtraKeys.mm_inputs items must be MultiModalInput or "
                    f"(content_hash, token_offset, num_tokens), got {item!r}"
                )
        items.sort(key=lambda m: (m.token_offset, m.num_tokens))
        object.__setattr__(self, "mm_inputs", tuple(items))

    def is_empty(self) -> bool:
        return self.cache_salt is None and self.lora_id is None and not self.mm_inputs

    def block_extras(self, block_index: int, block_size: int) -> bytes:
        """Canonical encoding of this block's extras; b"" when it has none."""
        start, end = block_index * block_size, (block_index + 1) * block_size
        items: list[list[object]] = []
        if block_index == 0 and self.cache_salt is not None:
            items.append(["salt", self.cache_salt])
        if self.lora_id is not None:
            items.append(["lora", self.lora_id])
        for mm in self.mm_inputs:
            if mm.token_offset < end and mm.token_offset + mm.num_tokens > start:
                items.append(["mm", mm.content_hash, mm.token_offset])
        return msgpack.packb(items, use_bin_type=True) if items else b""


def check_extra_keys(extra_keys: object) -> ExtraKeys | None:
    """`extra_keys` if it is an `ExtraKeys` or None; `InvalidInputError` naming its type otherwise."""
    if extra_keys is not None and not isinstance(extra_keys, ExtraKeys):
        raise InvalidInputError(f"extra_keys must be ExtraKeys or None, got {type(extra_keys).__name__}")
    return extra_keys


def tenant_of(seed: BlockHash, extra_keys: ExtraKeys | None) -> bytes:
    """The tenant a request's blocks belong to, for quotas: b"" without a cache salt, else 8
    bytes of a digest of the namespace seed and the salt (the salt itself is never kept)."""
    salt = None if extra_keys is None else extra_keys.cache_salt
    if salt is None:
        return b""
    raw = salt.encode() if isinstance(salt, str) else salt
    return xxhash.xxh3_64_digest(bytes(seed) + b"\x00salt\x00" + raw)


def as_token_array(tokens: object) -> np.ndarray:
    """Validate `tokens` and return them as a contiguous little-endian uint32 array.

    Accepts a Python sequence of ints (bools count as ints, as in Python), a NumPy integer
    array, or an integer torch tensor on any device. Raises `InvalidTokensError` for anything
    else: non-integers, more than one dimension, or values outside [0, 2**32).
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.layout != torch.strided or tokens.is_quantized or getattr(tokens, "is_nested", False):
            kind = "quantized" if tokens.is_quantized else "nested" if getattr(tokens, "is_nested", False) else str(
                tokens.layout)
            raise InvalidTokensError(f"tokens must be a dense integer tensor, got a {kind} tensor")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidTokensError(f"tokens must be integers, got a tensor of {tokens.dtype}")
        if tokens.device.type == "meta":
            raise InvalidTokensError("tokens must hold data, got a meta tensor")
        arr = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ma.MaskedArray):
        raise InvalidTokensError("tokens must not be a masked array: a masked entry has no token id")
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        raise InvalidTokensError(
            "tokens must be a sequence of ints, a NumPy array or a torch tensor, "
            f"got {type(tokens).__name__}"
        )
    else:
        try:  # fast path: C-level conversion that rejects floats and out-of-range ints
            return np.frombuffer(array.array(_U32_TYPECODE, tokens), dtype=np.uint32).astype("<u4", copy=False)
        except (TypeError, OverflowError, ValueError):
            pass  # fall through for a precise error message
        try:
            arr = np.asarray(tokens)
        except (ValueError, OverflowError, TypeError) as exc:
            raise InvalidTokensError(f"tokens must be integers in [0, 2**32): {exc}") from None
        if arr.size == 0:
            arr = arr.astype(np.uint32)
    if arr.ndim != 1:
        raise InvalidTokensError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == object:
        items = arr.tolist() if arr.ndim == 1 else []
        if arr.ndim == 1 and all(isinstance(t, (int, np.integer)) for t in items):
            bad = [int(t) for t in items if not 0 <= int(t) < _TOKEN_MAX]
            if bad:
                raise InvalidTokensError(f"tokens must lie in [0, 2**32), got {bad[0]}")
            return np.asarray([int(t) for t in items], dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise InvalidTokensError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_MAX):
        raise InvalidTokensError(
            f"tokens must lie in [0, 2**32), got values in [{int(arr.min())}, {int(arr.max())}]"
        )
    return np.ascontiguousarray(arr, dtype="<u4")


def _digest_fn(algo: HashAlgo) -> Callable[[bytes], bytes]:
    if algo is HashAlgo.XXH3_128:
        return xxhash.xxh3_128_digest
    return lambda data: hashlib.sha256(data).digest()


def _canonical_namespace(namespace: object) -> bytes:
    if isinstance(namespace, bytes):
        return namespace
    if isinstance(namespace, str):
        return namespace.encode()
    if isinstance(namespace, (list, tuple)):
        return bytes(msgpack.packb(list(namespace), use_bin_type=True))
    raise InvalidInputError(f"namespace must be str, bytes or a list of them, got {namespace!r}")


@lru_cache(maxsize=256)
def _seed(canonical: bytes, algo: HashAlgo) -> BlockHash:
    return BlockHash(_digest_fn(algo)(HASH_FORMAT_VERSION + canonical))


def namespace_seed(namespace: str | bytes | Sequence[object], algo: HashAlgo | str = "xxh3_128") -> BlockHash:
    """The chain's root: a digest of the namespace (model, layout, dtype, block size, ...)."""
    algo = parse_hash_algo(algo)
    return _seed(_canonical_namespace(namespace), algo)


def engine_block_hash(seed: BlockHash, key: object, algo: HashAlgo) -> BlockHash:
    """The store key of a block an engine names by its own id `key` (bytes, or text taken as
    UTF-8; 1 to `MAX_ENGINE_KEY_BYTES` bytes): `H(ENGINE_KEY_VERSION || seed || key)`. The
    namespace seed puts it in one store's namespace (two models never share an entry under
    one engine id), and the version tag keeps it apart from every chained token key.
    `InvalidInputError` naming a bad key."""
    if isinstance(key, str):
        _check_utf8("an engine block key", key)
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_ENGINE_KEY_BYTES:
        raise InvalidInputError(f"an engine block key must be 1 to {MAX_ENGINE_KEY_BYTES} bytes or text, "
                                f"got {key!r:.80}")
    return BlockHash(_digest_fn(algo)(ENGINE_KEY_VERSION + bytes(seed) + bytes(key)))


def block_hashes(
    tokens: object,
    block_size: int,
    *,
    namespace: str | bytes | Sequence[object],
    extra_keys: ExtraKeys | None = None,
    algo: HashAlgo | str = "xxh3_128",
) -> list[BlockHash]:
    """Chained hashes of every full block of `tokens` (a trailing partial block is ignored).

    Raises:
        InvalidTokensError: tokens are malformed (see `as_token_array`).
        InvalidInputError: block_size is not a positive int or extra_keys is malformed.
    """
    require_int("block_size", block_size, 1, InvalidInputError)
    check_extra_keys(extra_keys)
    arr = as_token_array(tokens)
    return chain_hashes(arr, block_size, namespace_seed(namespace, algo), extra_keys, parse_hash_algo(algo))


def chain_hashes(
    arr: np.ndarray,
    block_size: int,
    parent: BlockHash,
    extra_keys: ExtraKeys | None,
    algo: HashAlgo,
    first_block: int = 0,
) -> list[BlockHash]:
    """`block_hashes` for an already validated uint32 array.

    `parent` is the namespace seed when `first_block == 0`, else the hash of block
    `first_block - 1`; `arr` then holds the tokens from block `first_block` on, so a
    growing sequence is hashed incrementally.
    """
    digest = _digest_fn(algo)
    step = block_size * 4
    buf = arr.tobytes()
    num_blocks = len(arr) // block_size
    out: list[BlockHash] = []
    prev: bytes = parent
    if extra_keys is None or extra_keys.is_empty():
        for i in range(num_blocks):
            prev = digest(prev + buf[i * step : (i + 1) * step])
            out.append(BlockHash(prev))
    else:
        for i in range(num_blocks):
            extras = extra_keys.block_extras(first_block + i, block_size)
            prev = digest(prev + buf[i * step : (i + 1) * step] + extras)
            out.append(BlockHash(prev))
    return out


class BlockChain:
    """The chained hashes of one growing token sequence, extended as its blocks complete, so a
    request is hashed once. Bound to one namespace seed, block size, algorithm and extra keys.

    Invariant: `hashes[i]` is the key of block i of the tokens hashed so far. Tokens given
    later must extend those (checked byte for byte; a sequence that changed is rehashed from
    its first block, never served stale keys).
    """

    def __init__(self, seed: BlockHash, block_size: int, algo: HashAlgo, extra_keys: ExtraKeys | None) -> None:
        self.seed, self.block_size, self.algo, self.extra_keys = seed, block_size, algo, extra_keys
        self.hashes: list[BlockHash] = []
        self._hashed = b""  # the token bytes of the hashed blocks

    def extend(self, block_tokens: np.ndarray) -> list[BlockHash]:
        """Hash the full blocks that follow the blocks hashed so far: `block_tokens` are
        their token ids (validated uint32, a whole number of blocks). Returns every key so far
        (`hashes`); the new ones are appended to it."""
        if len(block_tokens) % self.block_size:
            raise InvalidInputError(f"extend takes whole blocks of {self.block_size} tokens, got {len(block_tokens)}")
        if len(block_tokens):
            parent = self.hashes[-1] if self.hashes else self.seed
            self.hashes.extend(chain_hashes(block_tokens, self.block_size, parent, self.extra_keys, self.algo,
                                            first_block=len(self.hashes)))
            self._hashed += block_tokens.tobytes()
        return self.hashes

    def prefix(self, num_blocks: int) -> BlockChain:
        """A new chain holding the keys of this one's first `num_blocks` blocks (hashes nothing):
        for another thread to use while this one grows."""
        copy = BlockChain(self.seed, self.block_size, self.algo, self.extra_keys)
        n = min(num_blocks, len(self.hashes))
        copy.hashes, copy._hashed = self.hashes[:n], self._hashed[: n * self.block_size * 4]
        return copy

    def hashes_of(self, arr: np.ndarray) -> list[BlockHash]:
        """Keys of every full block of `arr` (validated uint32 tokens), hashing only new blocks."""
        num_full = len(arr) // self.block_size
        common = min(num_full, len(self.hashes)) * self.block_size  # tokens both cover
        if arr[:common].tobytes() != self._hashed[: common * 4]:
            self.hashes, self._hashed = [], b""  # not the same sequence: start over
        done = len(self.hashes)
        if num_full > done:
            parent = self.hashes[-1] if self.hashes else self.seed
            new = arr[done * self.block_size : num_full * self.block_size]
            self.hashes.extend(chain_hashes(new, self.block_size, parent, self.extra_keys, self.algo, first_block=done))
            self._hashed += new.tobytes()
        return self.hashes[:num_full]
