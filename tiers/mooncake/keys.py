"""The Mooncake tier's object keys and its namespace's generation.

- `kvstrata:<namespace digest hex>:gen2`: the namespace's generation, 16 random hex digits;
- `kvstrata:<namespace digest hex>:2.<generation>:<block hash hex>`: a block's record.

The same shapes as the remote tier's server keys (`tiers/remote/keys.py`), as text (Mooncake's
keys are strings). A clear writes a fresh generation: from then on no reader finds a block of
an older one (every read asks for the generation in the same batch as its blocks, and every
lookup and write reads it first), and the old blocks are removed by a regular expression that
matches only kvstrata's block keys of this namespace (or of every namespace) of other
generations. A lost generation (evicted, removed) is replaced by a fresh random value, never
by one an older generation had. Mooncake's `put` never replaces an object, so two stores that
create the generation at once both adopt the one that was stored.
"""

from __future__ import annotations

import re
import secrets

_GEN_DIGITS = 16
_GENERATION = re.compile(rf"[0-9a-f]{{{_GEN_DIGITS}}}")
GENERATION_BYTES = _GEN_DIGITS  # the value of the generation key
_BLOCK = rf"2\.[0-9a-f]{{{_GEN_DIGITS}}}:(?:[0-9a-f]{{2}})+"


def new_generation() -> str:
    """A fresh generation: 64 random bits, as hex digits."""
    return secrets.token_hex(_GEN_DIGITS // 2)


def parse_generation(value: bytes | memoryview) -> str | None:
    """The generation a stored value names, or None if it is not one."""
    try:
        text = bytes(value).decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if _GENERATION.fullmatch(text) else None


class KeyLayout:
    """The object keys of one namespace."""

    def __init__(self, namespace: bytes) -> None:
        self.digest = bytes(namespace).hex()[:32]
        self.prefix = f"kvstrata:{self.digest}:"
        self.generation_key = self.prefix + "gen2"

    def key(self, generation: str, block_hash: bytes) -> str:
        """The key of `block_hash`'s record in `generation`."""
        return f"{self.prefix}2.{generation}:{bytes(block_hash).hex()}"

    def stale_pattern(self, generation: str) -> str:
        """A regular expression (ECMAScript, Mooncake's `remove_by_regex`) for this namespace's
        block keys of every generation but `generation`."""
        return rf"^kvstrata:{self.digest}:(?!2\.{generation}:){_BLOCK}$"

    def swept_pattern(self, generation: str) -> str:
        """For every namespace's generation and block keys kvstrata wrote, but this namespace's
        generation key and its blocks of `generation` (written after the clear began)."""
        keep = rf"kvstrata:{self.digest}:(?:gen2|2\.{generation}:)"
        return rf"^(?!{keep})kvstrata:[0-9a-f]{{1,32}}:(?:gen2|{_BLOCK})$"
