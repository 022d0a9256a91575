"""Bearer tokens of kvstrata's HTTP listeners (`kvstrata router`, an engine's control
listener): reading one from its file, and checking a request's `Authorization` header
against it in constant time."""

from __future__ import annotations

import hmac

from kvstore.errors import ConfigError

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
