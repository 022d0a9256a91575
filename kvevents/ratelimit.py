"""Token buckets per peer, for rate-limiting what a listening socket does for its peers."""

from __future__ import annotations

import time
from collections import OrderedDict


class TokenBuckets:
    """One bucket per peer name: `rate` tokens a second, at most `burst`. At most `max_peers`
    buckets are kept (the least recently used is forgotten, so its peer starts full again:
    the state stays bounded whatever peers claim to be)."""

    def __init__(self, rate: float, burst: float, max_peers: int) -> None:
        self.rate, self.burst, self.max_peers = rate, burst, max_peers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, peer: str, now: float | None = None) -> bool:
        """Spend one token of `peer`'s bucket; False (nothing spent) if it is empty."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)
