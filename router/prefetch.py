"""`POST /prefetch`: forward a prefetch to the instance `/lookup` would choose.

Each instance may have a control URL (`http://HOST:PORT`, its connector's `control_endpoint`;
from `--control NAME=URL` or `/register`'s `control_url`). The router chooses the instance
exactly as `/lookup` does, then POSTs `{"prompt_token_ids", "cache_salt"?, "wait_s"?}` to
`URL/prefetch` with the router's own bearer token (if it has one), waits at most
`FORWARD_TIMEOUT_S` (plus the `wait_s` asked for), and reads at most `MAX_ANSWER_BYTES` of the
answer, nested at most `MAX_ANSWER_DEPTH` deep. At most `MAX_IN_FLIGHT` forwards wait on
instances at once (each holds its parsed body until it ends): one more is a counted 429 at
once. A failed or timed-out forward (or an answer past those bounds) is a counted 502 or
504; nothing is retried.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from router.lookup import BadRequest, LookupQuery

FORWARD_TIMEOUT_S = 5.0
MAX_WAIT_S = 10.0  # what an instance's control listener waits at most
MAX_ANSWER_BYTES = 64 << 10
MAX_ANSWER_DEPTH = 16  # an instance's answer is a flat object: deeper nesting is refused
MAX_CONNECTIONS = 64
MAX_IN_FLIGHT = 4 * MAX_CONNECTIONS  # forwards waiting on instances at once, at most


def check_control_url(url: object, what: str = "control_url") -> str:
    """`url` as `http://HOST:PORT` (nothing else: no path, query, user or password);
    `ConfigError` naming `what`."""
    if not isinstance(url, str) or len(url) > 512:
        raise ConfigError(f"{what} must be http://HOST:PORT, got {str(url)[:80]!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{what} must be http://HOST:PORT, got {url[:80]!r}") from None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username is not None or parts.password is not None:
        raise ConfigError(f"{what} must be http://HOST:PORT (no path, query or credentials), got {url[:80]!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


def parse_control(text: str) -> tuple[str, str]:
    """`NAME=http://HOST:PORT` (the form of `--control`) as (instance name, URL)."""
    name, sep, url = text.partition("=")
    if not sep or not name or len(name) > 256:
        raise ConfigError(f"--control takes NAME=http://HOST:PORT, got {text[:80]!r}")
    return name, check_control_url(url, "--control")


def prefetch_wait(body: object) -> float:
    """Pop and check the `wait_s` a `/prefetch` body may carry beside `/lookup`'s fields."""
    if not isinstance(body, dict):
        return 0.0
    wait = body.pop("wait_s", 0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_S:
        raise BadRequest(f"wait_s must be a number in [0, {MAX_WAIT_S:g}], got {str(wait)[:80]}")
    return float(wait)


class Forwarder:
    """Forwards prefetches over one aiohttp client session; counts what became of them."""

    def __init__(self, token: str | None, timeout_s: float = FORWARD_TIMEOUT_S) -> None:
        self._token, self.timeout_s = token, timeout_s
        self._session: Any = None
        self.max_in_flight, self.in_flight = MAX_IN_FLIGHT, 0  # read and changed on the router's loop only
        self.num_forwarded = self.num_failed = self.num_timeouts = self.num_no_control = self.num_busy = 0

    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, url: str, query: LookupQuery, wait_s: float) -> tuple[int, Any]:
        """POST the prefetch to `url`; (status, the instance's answer as JSON) if it answered,
        (502, why) if it failed or answered something unreadable, (504, why) after the timeout,
        (429, why) at once if `max_in_flight` forwards wait already."""
        if self.in_flight >= self.max_in_flight:
            self.num_busy += 1
            return 429, f"{self.max_in_flight} prefetches already wait on their instances"
        self.in_flight += 1
        try:
            return await self._forward(url, query, wait_s)
        finally:
            self.in_flight -= 1

    async def _forward(self, url: str, query: LookupQuery, wait_s: float) -> tuple[int, Any]:
        import aiohttp

        body: dict[str, Any] = {"prompt_token_ids": query.tokens.tolist()}
        if query.salt is not None:
            body["cache_salt"] = query.salt
        if wait_s:
            body["wait_s"] = wait_s
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            status, answer = await asyncio.wait_for(self._post(f"{url}/prefetch", body, headers),
                                                    self.timeout_s + wait_s)
        except asyncio.TimeoutError:
            self.num_timeouts += 1
            return 504, f"the instance did not answer within {self.timeout_s + wait_s:g} s"
        except (aiohttp.ClientError, OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            self.num_failed += 1
            return 502, f"the instance failed: {type(exc).__name__}: {str(exc)[:200]}"
        self.num_forwarded += 1
        return status, answer

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
        async with self._session.post(url, json=body, headers=headers, allow_redirects=False) as resp:
            raw = b""
            while chunk := await resp.content.read(MAX_ANSWER_BYTES + 1 - len(raw)):
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    raise ValueError(f"an answer longer than {MAX_ANSWER_BYTES} bytes")
            answer = json.loads(raw)
            if not _shallow(answer, MAX_ANSWER_DEPTH):
                raise ValueError(f"an answer nested deeper than {MAX_ANSWER_DEPTH} levels")
            return resp.status, answer


def _shallow(value: object, depth: int) -> bool:
    """Whether JSON `value` nests no deeper than `depth` levels (so the router's own answer,
    which wraps it, is written without hitting the recursion limit)."""
    if isinstance(value, (list, dict)):
        if depth <= 0:
            return False
        items = value.values() if isinstance(value, dict) else value
        return all(_shallow(v, depth - 1) for v in items)
    return True
