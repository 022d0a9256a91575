"""What the router listens on and subscribes to, validated (errors name the bad value)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvevents import CurveClient, check_endpoint, check_public_key
from kvstore import bearer
from kvstore.errors import ConfigError
from router.fleet import Limits
from router.lookup import Scoring
from router.prefetch import check_control_url


@dataclass(frozen=True)
class Subscription:
    """One event source: its endpoint (the source's identity), the instance name it reports
    under (default: the endpoint), its replay endpoint, a model label, and the publisher's
    CURVE public key (Z85; None: the router's default, or plain text without one)."""

    endpoint: str
    name: str = ""
    replay: str | None = None
    model: str | None = None
    curve_server_key: bytes | None = None

    def __post_init__(self) -> None:
        check_endpoint(self.endpoint, "subscription endpoint")
        if self.replay is not None:
            check_endpoint(self.replay, "replay endpoint")
        if not isinstance(self.name, str) or len(self.name) > 256:
            raise ConfigError(f"an instance name must be a str of at most 256 characters, got {self.name!r}")
        if not self.name:
            object.__setattr__(self, "name", self.endpoint)
        if self.model is not None and (not isinstance(self.model, str) or not 0 < len(self.model) <= 256):
            raise ConfigError(f"a model label must be a non-empty str of at most 256 characters, got {self.model!r}")

    @classmethod
    def parse(cls, text: str) -> Subscription:
        """`[NAME=]ENDPOINT[,REPLAY_ENDPOINT]` (the form of `--subscribe`)."""
        name, sep, rest = text.partition("=")
        if not sep or "://" in name:
            name, rest = "", text
        endpoint, _, replay = rest.partition(",")
        return cls(endpoint, name, replay or None)


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings.

    Attributes:
        subscriptions: sources followed from the start (more come over `POST /register`).
        scoring: how `best` is chosen.
        limits: bounds on the state kept per source.
        curve: the router's own CURVE keys, for publishers that require them.
        curve_server_key: the publishers' CURVE public key where a subscription names none.
        token: the bearer token every request but `GET /healthz` must carry (None: none
            needed; then `/register` and `/unregister` answer only on a loopback address);
            `POST /prefetch` forwards it to the instances' control listeners.
        controls: (instance name, `http://HOST:PORT`) of instances' control listeners, where
            `POST /prefetch` forwards (more come with `/register`'s `control_url`).
    """

    subscriptions: tuple[Subscription, ...] = ()
    scoring: Scoring = field(default_factory=Scoring)
    limits: Limits = field(default_factory=Limits)
    curve: CurveClient | None = None
    curve_server_key: bytes | None = None
    token: str | None = field(default=None, repr=False)
    controls: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.limits.stale_after_s < 3600:
            raise ConfigError(f"stale_after_s must be in (0, 3600), got {self.limits.stale_after_s!r}")
        keys = [self.curve_server_key, *(s.curve_server_key for s in self.subscriptions)]
        for key in keys:
            if key is not None:
                check_public_key(key.decode() if isinstance(key, bytes) else key, "a publisher's CURVE key")
        if any(k is not None for k in keys) and self.curve is None:
            raise ConfigError("publisher CURVE keys are given but the router has no keys of its own: give --curve-cert")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16):
            raise ConfigError("the router's token must be at least 16 characters")
        object.__setattr__(self, "controls", tuple((name, check_control_url(url, f"control URL of {name!r}"))
                                                   for name, url in self.controls))


def read_token(path: str) -> str:
    """The bearer token in a file (its first line); `ConfigError` naming the file."""
    return bearer.read_token("--token-file", path)
