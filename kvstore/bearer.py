"""Bearer tokens of kvstrata's HTTP listeners (`kvstrata router`, an engine's control
listener): reading one from its file, checking a request's `Authorization` header against
it in constant time, and logging requests without it (`BearerGate`)."""

from __future__ import annotations

import hmac
import logging

from kvstore.errors import ConfigError
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


def read_token(what: str, path: str) -> str:
    """The bearer token in the file `path` (its first line, at least `MIN_TOKEN_CHARS`
    characters); `ConfigError` naming `what` and the file, never the token."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path!r} cannot be read: {exc}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{what} {path!r} holds no token of at least {MIN_TOKEN_CHARS} characters")
    return token


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header (`Bearer TOKEN`) carries `token`, compared in
    constant time."""
    given = (header or "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


class BearerGate:
    """A listener's token check that is never silent: each request without the right token
    is logged in a rate-limited warning naming `what` and the peer's address (never the
    token). Failures are not locked out per address: a token of `MIN_TOKEN_CHARS` or more
    cannot be guessed at any rate a listener serves, and a lock-out would let one client
    behind a shared address (a NAT, a proxy) shut out the others."""

    def __init__(self, token: str | None, what: str) -> None:
        self.token, self.what = token, what
        self._warn = RateLimitedWarning(logger)

    def check(self, header: str | None, peer: str | None) -> bool:
        """Whether a request's `Authorization` header passes (always, without a token)."""
        if self.token is None or bearer_matches(header, self.token):
            return True
        self.refused(peer, "without the right bearer token")
        return False

    def refused(self, peer: str | None, why: str) -> None:
        """Log (rate-limited) a request from `peer` the listener refuses for a reason of its
        own (`why`, e.g. a path that answers only loopback clients)."""
        self._warn(f"{self.what}: a request from {peer or 'an unknown address'} {why} (401)")
