"""The remote tier's server keys (layout 2) and its namespace's generation.

- `kvstrata:<namespace digest hex>:gen2`: the namespace's generation, 16 random hex digits;
- `kvstrata:<namespace digest hex>:2.<generation>:<block hash hex>`: a block's record.

Every key of a namespace starts with `kvstrata:<namespace digest hex>:`, so a namespace is
listed or dropped by prefix (SCAN, never KEYS). Keys of layout 1 (`...:<block hash hex>`,
before generations) are never read; a clear deletes them. Keys of other shapes under the
prefix are not kvstrata's: never deleted.

A clear sets a fresh generation: from then on no reader finds a block of an older one,
whether the sweep that deletes them has reached it yet or not (every read and lookup asks for
the generation in the same round trip as its blocks, and a change ends that call as a miss).
A generation is random, not a counter: a generation key that was lost (evicted by the
server's LRU, deleted by an all-namespace clear) is replaced by a fresh value (SET NX), never
by a value an older generation had.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any, TypeGuard

from tiers.keys import BlockHash
from tiers.remote.stream import Op, command

_GEN_DIGITS = 16
_HEX = re.compile(rb"(?:[0-9a-f]{2})+")
_GENERATION = re.compile(rb"[0-9a-f]{%d}" % _GEN_DIGITS)
# any namespace's kvstrata key: generation, a block of layout 2, a block of layout 1
_KVSTRATA_KEY = re.compile(rb"kvstrata:[0-9a-f]{1,32}:(?:gen2|2\.[0-9a-f]{%d}:(?:[0-9a-f]{2})+|(?:[0-9a-f]{2})+)"
                           % _GEN_DIGITS)


def new_generation() -> bytes:
    """A fresh generation: 64 random bits, as hex digits."""
    return secrets.token_hex(_GEN_DIGITS // 2).encode()


def is_generation(value: object) -> TypeGuard[bytes]:
    """Whether `value` (a server's reply) is a well-formed generation."""
    return isinstance(value, bytes) and _GENERATION.fullmatch(value) is not None


def is_kvstrata_key(key: bytes) -> bool:
    """Whether `key` has the shape of a key kvstrata writes (any namespace, either layout)."""
    return _KVSTRATA_KEY.fullmatch(key) is not None


class KeyLayout:
    """The keys of one namespace."""

    def __init__(self, namespace: bytes) -> None:
        self.prefix = b"kvstrata:" + namespace.hex()[:32].encode() + b":"
        self.generation_key = self.prefix + b"gen2"

    def data_prefix(self, generation: bytes) -> bytes:
        """What the keys of blocks of `generation` start with."""
        return self.prefix + b"2." + generation + b":"

    def key(self, generation: bytes, block_hash: bytes) -> bytes:
        return self.data_prefix(generation) + bytes(block_hash).hex().encode()

    def parse(self, key: bytes) -> tuple[bytes, BlockHash]:
        """The generation and block hash of a block key of this namespace (layout 2);
        `ValueError` for any other key."""
        rest = key[len(self.prefix) :] if key.startswith(self.prefix + b"2.") else b""
        generation, _, digits = rest[2:].partition(b":")
        if _GENERATION.fullmatch(generation) is None or _HEX.fullmatch(digits) is None:
            raise ValueError(f"not a block key of this namespace: {key[:80]!r}")
        return generation, BlockHash(bytes.fromhex(digits.decode()))

    def blocks_of(self, keys: list[bytes], generation: bytes) -> tuple[list[BlockHash], int]:
        """The block hashes of `keys` that are this namespace's blocks of `generation`, and how
        many of `keys` are not kvstrata's (the generation key and old blocks are neither)."""
        found, foreign = [], 0
        for key in keys:
            try:
                gen, block_hash = self.parse(key)
            except ValueError:
                foreign += not is_kvstrata_key(key)
                continue
            if gen == generation:
                found.append(block_hash)
        return found, foreign

    def is_stale(self, key: bytes, generation: bytes) -> bool:
        """Whether a clear of this namespace at `generation` deletes `key`: a block key of this
        namespace of another generation or of layout 1 (the generation key and anything not
        kvstrata's stay)."""
        if not key.startswith(self.prefix) or key == self.generation_key or not is_kvstrata_key(key):
            return False
        return not key.startswith(self.data_prefix(generation))

    def is_swept(self, key: bytes, generation: bytes) -> bool:
        """Whether a clear of every namespace at `generation` deletes `key`: any kvstrata key
        but this namespace's generation and its blocks of `generation` (written after the
        clear began)."""
        if key == self.generation_key or key.startswith(self.data_prefix(generation)):
            return False
        return is_kvstrata_key(key)


class Generation:
    """The generation one tier's calls use: the server's as last read, or, until it is known,
    a fresh value no block has. `call(fn)` runs `fn(client)` on the server (None: a fault,
    counted by the caller); `on_bad(exc)` counts a generation the server holds that is not one."""

    def __init__(self, layout: KeyLayout, call: Callable[[Callable[[Any], Any]], Any],
                 on_bad: Callable[[Exception], None]) -> None:
        self._layout = layout
        self._call = call
        self._on_bad = on_bad
        self.value = new_generation()
        self.known = False

    def sync(self) -> bool:
        """Adopt the server's generation, creating a fresh one (SET NX) where it has none;
        False if the server did not tell."""
        key = self._layout.generation_key
        replies = self._call(lambda c: tuple(c.pipeline(transaction=False).set(key, new_generation(), nx=True)
                                             .get(key).execute(raise_on_error=False)))
        value = replies[-1] if replies else None
        if not is_generation(value):
            if replies:  # a refused GET, or a value kvstrata does not write
                self._on_bad(ValueError(f"the server holds {str(value)[:80]} as the generation"))
            return False
        self.adopt(value)
        return True

    def adopt(self, value: bytes) -> None:
        self.value, self.known = value, True

    def now(self) -> bytes | None:
        """The generation a call's keys are under (read from the server first if not known
        or lost); None if the server did not tell: the call is a miss or a drop."""
        if not self.known and not self.sync():
            return None
        return self.value

    def op(self) -> Op:
        """A call's first command: GET the generation, in the same round trip as its blocks."""
        key = self._layout.generation_key
        return Op(key, command(b"GET", key), 2 * len(key))

    def check(self, generation: bytes, reply: Any) -> bool:
        """Whether the server's generation (`reply` to `op()`) is `generation`, the one the
        call's keys are under. If not (a clear by any store, or the key lost), the call stops,
        a miss, and the next one uses the server's generation (a fresh one if it has none)."""
        if reply == generation:
            return True
        if is_generation(reply) and self.value == generation:
            self.value = reply
        elif reply is None:
            self.known = False
        return False
