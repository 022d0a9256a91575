"""One event source as the router knows it, its slot's chain map, and its budgets.

A source is one subscription: the endpoint the router connects to (its identity: nothing a
message says can make it another source) and the instance name it reports under. Several
sources may share a name (a kvstrata store and its engine's own vLLM events are one
instance). Per source: the sequence of the batches applied, whether a replay is under way
(live batches are buffered meanwhile, bounded), its slot in the index, and its budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIER_OF_MEDIUM = {
    None: 0, "GPU": 0, "DEVICE": 0,
    "CPU": 1, "CPU_PINNED": 1, "CPU_TIER1": 1,
    "DISK": 2, "STORAGE": 2, "NVME": 2, "CPU_TIER2": 2,
    "SHARED": 3, "EXTERNAL": 3, "REMOTE": 3, "NETWORK": 3,
}
MEDIUM_OF_TIER = ("GPU", "CPU", "DISK", "SHARED")
REMOTE_TIER = 3


@dataclass
class Bucket:
    """A token bucket: `rate` a second, at most `burst`; starts full."""

    rate: float
    burst: float
    tokens: float = -1.0  # full, on the first `take`
    last: float = 0.0

    def take(self, amount: float, now: float) -> bool:
        """Spend `amount` if the bucket holds it (else spend nothing); whether it did."""
        if self.tokens < 0:
            self.tokens, self.last = self.burst, now
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = now
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True


@dataclass
class Slot:
    """A source's place in the index and its chain map: publisher block hash -> (router key,
    tier bits held)."""

    index: int
    chain: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class Source:
    """One subscription."""

    endpoint: str
    name: str
    slot: Slot
    replay_endpoint: str | None = None
    model: str | None = None  # given at registration: wins over what events say
    curve_server_key: bytes | None = None  # the publisher's CURVE public key
    registered: bool = False  # came from POST /register (else from the command line)
    seq: int | None = None  # last batch applied
    replaying: bool = False
    buffered: list[tuple[int, list[Any]]] = field(default_factory=list)
    last_seen: float = 0.0
    last_replay: float = -1e9
    block_size: int | None = None
    announced_model: str | None = None
    epoch: int | None = None
    remote: tuple[str, str] | None = None  # the shared remote tier it is a member of (identity, namespace)
    num_batches: int = 0
    num_bad: int = 0
    num_unmapped: int = 0
    num_dropped: int = 0  # blocks past the bound on blocks per source
    num_throttled: int = 0  # messages dropped over its budgets
    bytes_budget: Bucket | None = None  # bytes of messages a second (set by the fleet)
    claims_budget: Bucket | None = None  # live batches claiming a restart or a clear, a second

    @property
    def label(self) -> str | None:
        return self.model if self.model is not None else self.announced_model

    def reset(self) -> None:
        """Forget the stream position (the publisher restarted, or went silent)."""
        self.seq, self.replaying, self.buffered = None, False, []
        self.block_size, self.epoch = None, None
