"""Which blocks of each vLLM KV cache group kvstrata stores and loads.

vLLM's hybrid KV cache manager gives each kind of layer its own group with its own block
table: full attention keeps every block of the prefix; a sliding window keeps the blocks its
window reaches back to; chunked local attention the blocks of the current chunk; a state
group (Mamba, linear attention) one recurrent state per block boundary. Blocks a group no
longer needs are the null block (id 0) in its table.

`GroupRule` says, as pure arithmetic over block indices, what a hit of the first `n` blocks
needs from a group (`needed`), so the scheduler calls a prefix a hit only where every group
can serve it, and the planner stores exactly that: after each step, the blocks a hit ending
at the step's last full block would need. `rule_for` maps a vLLM spec to its rule and refuses,
in one `ConfigError` naming it, every spec kvstrata cannot serve exactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block: never data


class GroupKind(enum.Enum):
    FULL = "full"  # every block of the prefix
    WINDOW = "window"  # the blocks a sliding window of `span` tokens reaches back to
    CHUNKED = "chunked"  # the blocks of the current attention chunk of `span` tokens
    STATE = "state"  # one state per block boundary: the state after the block's last token


@dataclass(frozen=True)
class GroupRule:
    """What one KV cache group holds, by block index (block `i` covers tokens
    `[i * block_size, (i + 1) * block_size)`)."""

    kind: GroupKind
    block_size: int
    span: int = 0  # WINDOW: the window in tokens; CHUNKED: the chunk in tokens

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"a KV cache group's block size must be positive, got {self.block_size}")
        if self.kind in (GroupKind.WINDOW, GroupKind.CHUNKED) and self.span < 1:
            raise ConfigError(f"a {self.kind.value} group needs a positive span, got {self.span}")

    def needed(self, num_blocks: int) -> range:
        """The blocks of this group that a hit of the first `num_blocks` blocks needs: the
        next token (at position `num_blocks * block_size`) attends to them, or continues
        from their state. Empty for a hit of 0 blocks."""
        n, b = num_blocks, self.block_size
        if n <= 0:
            return range(0)
        if self.kind is GroupKind.FULL:
            return range(0, n)
        if self.kind is GroupKind.WINDOW:  # the window before position n * b: span - 1 tokens
            return range(max(0, n - -(-(self.span - 1) // b)), n)
        if self.kind is GroupKind.CHUNKED:  # from the start of the chunk holding n * b
            return range(n * b // self.span * self.span // b, n)
        return range(n - 1, n)  # STATE: the state at the boundary n * b

    def loadable(self, block: int, block_id: int) -> bool:
        """Whether engine block `block_id` may receive block `block`: any for full attention;
        never the null block (a block vLLM does not need)."""
        return self.kind is GroupKind.FULL or block_id != NULL_BLOCK_ID

    def savable(self, block: int, block_id: int, num_done: int, step_end: int) -> bool:
        """Whether block `block`, in engine block `block_id`, is saved after a step that
        ended at token `step_end` with the request's first `num_done` blocks complete: it is
        one a hit of `num_done` blocks needs, vLLM still holds it, and (for a state) the
        step ended exactly on its boundary, so the state there is the state after it."""
        if block not in self.needed(num_done):
            return False
        if self.kind is GroupKind.FULL:
            return True
        if block_id == NULL_BLOCK_ID:
            return False
        return self.kind is not GroupKind.STATE or step_end == (block + 1) * self.block_size


def rule_for(spec: Any, group_index: int) -> GroupRule:
    """The rule of a vLLM `KVCacheSpec`, or a `ConfigError` naming a spec kvstrata cannot
    serve exactly (checked at start-up, by exact type: a subclass may change what a block
    holds). Full attention with a window or chunk set is vLLM's hybrid manager turned off:
    full-length KV, served as full attention."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"kvstrata cannot serve KV cache group {group_index} ({name}): {why}")

    if type(spec) in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec):
        mode = getattr(spec, "kv_quant_mode", None)
        if mode is not None and getattr(mode, "is_per_token_head", False):
            raise refuse(f"per-token-head KV quantization ({mode.name}) keeps scales outside the blocks")
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        if getattr(spec, "non_causal", False):
            raise refuse("non-causal attention: a block's KV is not a function of its prefix")
        return GroupRule(GroupKind.FULL, spec.block_size)
    if type(spec) is SlidingWindowSpec:
        if spec.extra_retained_tokens:
            raise refuse(f"extra_retained_tokens={spec.extra_retained_tokens} (speculative decoding)")
        return GroupRule(GroupKind.WINDOW, spec.block_size, spec.sliding_window)
    if type(spec) is ChunkedLocalAttentionSpec:
        return GroupRule(GroupKind.CHUNKED, spec.block_size, spec.attention_chunk_size)
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise refuse(
                f"mamba_cache_mode={spec.mamba_cache_mode!r} keeps one running state per request, none at "
                "block boundaries (vLLM keeps them in 'align' mode, with prefix caching on)"
            )
        if spec.num_speculative_blocks:
            raise refuse(f"num_speculative_blocks={spec.num_speculative_blocks} (speculative decoding)")
        return GroupRule(GroupKind.STATE, spec.block_size)
    raise refuse("a kind of KV cache kvstrata does not know (served: full, MLA, sliding-window and chunked "
                 "attention, and Mamba/linear-attention state in 'align' mode)")


# vLLM's speculative-decoding methods whose proposer keeps no KV in vLLM's KV cache: with
# them the cache holds the target model's KV alone, which is a function of the prefix.
KV_FREE_PROPOSERS = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"})


def check_speculation(method: str | None) -> None:
    """`ConfigError` naming `method` (vLLM's `speculative_config.method`; None: no speculative
    decoding) unless its proposer keeps no KV in vLLM's KV cache."""
    if method is None or method in KV_FREE_PROPOSERS:
        return
    raise ConfigError(
        f"kvstrata cannot serve speculative decoding with method {method!r}: its drafter keeps KV in vLLM's KV "
        "cache beside the target model's (an EAGLE or MTP drafter's even depends on the token after each "
        "block), and kvstrata would store it under the target's keys; use a method without drafter KV "
        f"({', '.join(sorted(KV_FREE_PROPOSERS))}) or run this engine without the connector")
