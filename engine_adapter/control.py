"""An engine's control listener: `POST /prefetch` over HTTP, beside the engine's store.

A client (or `kvstrata router`'s `POST /prefetch`) tells an engine, before a request arrives,
to warm its CPU tier with that request's prefix from disk or a remote tier. The body is
`{"prompt_token_ids": [...], "cache_salt"?: str, "max_blocks"?: int, "wait_s"?: number}`;
the listener keys it as the engine keys such a request (the salt enters the first block, the
store's namespace the rest) and calls `KVCacheStore.prefetch` in the background, answering
202 at once with what it queued, or, with `wait_s` (at most `MAX_WAIT_S`), 200 with the
prefetch's result if it ends by then. What cannot be keyed from the body alone is refused: a
LoRA adapter (`lora_name`: its files' content enters the keys, not its name), multimodal inputs
(any other field). Nothing here is trusted: loopback unless told otherwise, and then only
with a bearer token (compared in constant time); bodies capped at `MAX_BODY_BYTES`; requests
rate-limited (`RATE_PER_S`, bursts of `BURST`: 429); a bad body is a 400 naming the field,
and every refusal is counted (`counters`). aiohttp serves it on a thread of its own.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

from kvevents import TokenBuckets
from kvstore import ExtraKeys, InvalidInputError, KVCacheStore, PrefetchResult, PrefetchStatus, StoreClosedError
from kvstore.bearer import BearerGate
from kvstore.errors import ConfigError
from kvstore.prefetch import MAX_PREFETCH_BLOCKS
from tiers.shared.ratelimit import RateLimitedWarning

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # about 1 M token ids as JSON
MAX_TOKENS = 1 << 20
MAX_WAIT_S = 10.0
RATE_PER_S = 50.0
BURST = 100
FIELDS = ("prompt_token_ids", "cache_salt", "lora_name", "max_blocks", "wait_s")
COUNTERS = ("requests", "accepted", "bad_requests", "unauthorized", "rate_limited", "dropped", "unavailable")


class BadField(Exception):
    """A body the listener refuses: `field` names the bad field, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class PrefetchAsk(NamedTuple):
    """A validated `POST /prefetch` body."""

    tokens: list[int]
    extra_keys: ExtraKeys | None
    max_blocks: int | None
    wait_s: float


def parse_prefetch(body: object) -> PrefetchAsk:
    """Validate a decoded JSON body; `BadField` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadField("body", f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(str(k)[:80] for k in body if k not in FIELDS)
    if unknown:
        raise BadField(unknown[0], f"unknown fields {unknown[:10]}: nothing else can be keyed safely; "
                                   f"known: {list(FIELDS)}")
    if body.get("lora_name") is not None:
        raise BadField("lora_name", "a LoRA adapter cannot be keyed from its name alone (its files' content enters "
                                    "the keys): not prefetched")
    tokens = body.get("prompt_token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise BadField("prompt_token_ids", "prompt_token_ids must be a non-empty list of integers")
    if len(tokens) > MAX_TOKENS:
        raise BadField("prompt_token_ids", f"prompt_token_ids has {len(tokens)} tokens, more than {MAX_TOKENS}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32 for t in tokens):
        raise BadField("prompt_token_ids", "prompt_token_ids must be integers in [0, 2**32)")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= 4096):
        raise BadField("cache_salt", "cache_salt must be a string of 1 to 4096 characters")
    cap = body.get("max_blocks")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_PREFETCH_BLOCKS):
        raise BadField("max_blocks", f"max_blocks must be an integer in [1, {MAX_PREFETCH_BLOCKS}]")
    wait = body.get("wait_s", 0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_S:
        raise BadField("wait_s", f"wait_s must be a number in [0, {MAX_WAIT_S:g}]")
    return PrefetchAsk(tokens, ExtraKeys(cache_salt=salt) if salt else None, cap, float(wait))


def result_json(result: PrefetchResult) -> dict[str, Any]:
    """A `PrefetchResult` as JSON (block counts; `status` by name)."""
    out: dict[str, Any] = result._asdict()
    out["status"] = result.status.value
    return out


def is_loopback(host: str) -> bool:
    """Whether `host` names this host only (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_endpoint(name: str, text: object) -> tuple[str, int]:
    """`HOST:PORT` (`[V6]:PORT` for an IPv6 address) as (host, port); `ConfigError` naming `name`."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"{name} must be HOST:PORT, got {str(text)[:80]!r}")
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c.isspace() or c in "/[]@" for c in host) or not port.isascii() or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} must be HOST:PORT with a port in [1, 65535], got {text[:80]!r}")
    return host, int(port)


class _ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log: a request its HTTP parser refuses (answered 400 by aiohttp) is
    counted as a bad request and warned about at most every 10 s, without a traceback; any
    other exception (a defect) is logged with its traceback."""

    def __init__(self, count: Callable[[str], None]) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._count = count
        self._warn = RateLimitedWarning(logger)

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc_info, HttpProcessingError):
            self._count("bad_requests")
            self._warn(f"control listener refused a malformed HTTP request ({type(exc_info).__name__})")
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kw)


class ControlListener:
    """See the module docstring. `start()` binds (`ConfigError` if it cannot), `close()` stops it."""

    def __init__(self, store: KVCacheStore, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 rate_per_s: float = RATE_PER_S, burst: int = BURST) -> None:
        if not is_loopback(host) and token is None:
            raise ConfigError(f"a control listener on {host!r} is reachable from other hosts: give it a token "
                              "(control_token_file), or listen on loopback")
        if token is not None and (not isinstance(token, str) or len(token) < 16):
            raise ConfigError("a control listener's token must be at least 16 characters")
        self.store, self.host, self.port = store, host, port
        self._gate = BearerGate(token, f"control listener on {host}:{port}")
        self._limit = TokenBuckets(rate_per_s, burst, max_peers=1)  # one bucket for every client
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.on_count: Callable[[str, int], None] | None = None  # told each count (a connector's stats)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _count(self, name: str) -> None:
        self.counters[name] += 1
        if self.on_count is not None:
            self.on_count(f"control_{name}", 1)

    async def _prefetch(self, request: Any) -> Any:
        from aiohttp import web

        self._count("requests")
        if not self._gate.check(request.headers.get("Authorization"), request.remote):
            self._count("unauthorized")
            return web.json_response({"error": "unauthorized: this listener needs its bearer token"}, status=401)
        if not self._limit.take(""):
            self._count("rate_limited")
            return web.json_response({"error": f"rate limited ({RATE_PER_S:g}/s)"}, status=429)
        try:
            raw = await request.read()
            ask = parse_prefetch(json.loads(raw))
            cap = ask.max_blocks or MAX_PREFETCH_BLOCKS  # hash no more tokens than the prefetch may look at
            future = self.store.prefetch(ask.tokens[: cap * self.store.config.block_size], extra_keys=ask.extra_keys,
                                         max_blocks=ask.max_blocks)
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding its bytes do not decode as
            self._count("bad_requests")
            request.content.feed_eof()  # the rest is unreadable: no lingering read after this
            response = web.json_response({"error": f"body cannot be read: {' '.join(str(exc).split())[:200]}",
                                          "field": "body"}, status=400)
            response.force_close()
            return response
        except web.HTTPRequestEntityTooLarge:
            self._count("bad_requests")
            return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes", "field": "body"},
                                     status=413)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # not JSON (InvalidInputError is a ValueError)
            self._count("bad_requests")
            field = getattr(exc, "field", "prompt_token_ids" if isinstance(exc, InvalidInputError) else "body")
            return web.json_response({"error": str(exc)[:300], "field": field}, status=400)
        except BadField as exc:
            self._count("bad_requests")
            return web.json_response({"error": str(exc), "field": exc.field}, status=400)
        except StoreClosedError:
            self._count("unavailable")
            return web.json_response({"error": "the store is closed"}, status=503)
        return await self._answer(ask, future)

    async def _answer(self, ask: PrefetchAsk, future: Future[PrefetchResult]) -> Any:
        from aiohttp import web

        if future.done() and future.result().status is PrefetchStatus.DROPPED:
            self._count("dropped")
            return web.json_response({"status": "dropped", "error": "too many prefetches waiting"}, status=429)
        self._count("accepted")
        if ask.wait_s > 0:  # asyncio.wait never cancels the prefetch's future
            await asyncio.wait([asyncio.wrap_future(future)], timeout=ask.wait_s)
            if future.done():
                return web.json_response(result_json(future.result()), status=200)
        return web.json_response({"status": "queued", "num_tokens": len(ask.tokens),
                                  "max_blocks": ask.max_blocks or MAX_PREFETCH_BLOCKS}, status=202)

    async def _expect(self, request: Any) -> None:
        """`Expect: 100-continue`, or a counted 417 that does not quote the header (aiohttp's
        own handler does, which fails on bytes that are not UTF-8: a 500)."""
        from aiohttp import web

        if request.version != (1, 1):
            return
        if request.headers.get("Expect", "").lower() != "100-continue":
            self._count("bad_requests")
            raise web.HTTPExpectationFailed(text="the only Expect header this listener takes is 100-continue")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0

    async def _open(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/prefetch", self._prefetch, expect_handler=self._expect)
        self._runner = web.AppRunner(app, access_log=None, logger=_ProtocolLog(self._count))
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.port = self._runner.addresses[0][1]

    def start(self) -> ControlListener:
        """Serve on a thread of its own; `ConfigError` if aiohttp is missing or the address
        cannot be bound."""
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise ConfigError("a control listener needs aiohttp: pip install aiohttp") from None
        loop = asyncio.new_event_loop()
        opened: Future[None] = Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:
                opened.set_exception(exc)
                loop.close()
                return
            opened.set_result(None)
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="kvstrata-control", daemon=True)
        self._thread.start()
        opened.result()
        self._loop = loop
        logger.info("kvstrata: control listener on %s (POST /prefetch)", self.url)
        return self

    def close(self) -> None:
        """Stop serving (idempotent); waits for the thread."""
        loop, self._loop = self._loop, None
        if loop is not None and self._thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10.0)

    def __enter__(self) -> ControlListener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
