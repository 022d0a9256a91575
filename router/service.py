"""`kvstrata router`'s HTTP service (aiohttp): `POST /lookup`, `POST /prefetch`, `POST /register`,
`POST /unregister`, `GET /healthz`, `/instances`, `/metrics` (docs/routing.md).

With a token configured every request but `GET /healthz` must carry `Authorization: Bearer
TOKEN` (compared in constant time); without one, `/register` and `/unregister` answer only
requests from a loopback address. Bodies are capped (`MAX_BODY_BYTES`); a malformed one is a
400 naming the bad value, never a 500.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import time
from typing import Any

from kvstore.bearer import BearerGate
from kvstore.errors import ConfigError
from router.config import RouterConfig, Subscription
from router.fleet import FleetFull, FleetView
from router.index import TIERS
from router.lookup import BadRequest, Chooser, parse_body, parse_query, text_field
from router.metrics import LatencyHistogram, RouterCollector
from router.prefetch import Forwarder, check_control_url, prefetch_wait

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20
_OPEN = {"/healthz"}
_ROUTES = {"/lookup": "POST", "/prefetch": "POST", "/register": "POST", "/unregister": "POST", "/healthz": "GET",
           "/instances": "GET", "/metrics": "GET"}


def need_aiohttp() -> Any:
    try:
        from aiohttp import web
    except ImportError:
        raise ConfigError("kvstrata router needs aiohttp: pip install 'kvstrata[router]'") from None
    return web


class _ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log: a request its HTTP parser refuses (bad bytes in the request line
    or a header name, a duplicate Host, broken chunking: answered 400 by aiohttp) is counted as
    a bad request and warned about in one line at most every 10 s, without a traceback; any
    other exception (a defect of the router) is logged with its traceback as before."""

    def __init__(self, router: Router) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._router = router
        self._last_warning = -float("inf")

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc_info, HttpProcessingError):
            self._router.num_bad_requests += 1
            now = time.monotonic()
            if now - self._last_warning >= 10.0:
                self._last_warning = now
                logger.warning("refused a malformed HTTP request (%s; %d bad requests so far)",
                               type(exc_info).__name__, self._router.num_bad_requests)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kw)


def _is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class Router:
    """The service's state and handlers; `app()` builds the aiohttp application."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.fleet = FleetView(config.limits)
        self.chooser = Chooser(self.fleet, config.scoring)
        self.latency = LatencyHistogram()
        self.num_bad_requests = self.num_unauthorized = 0
        self._gate = BearerGate(config.token, "kvstrata router")
        self.subscriber: Any = None
        self._registry: Any = None
        self.controls = dict(config.controls)  # instance name -> its control URL (`router/prefetch.py`)
        self.forwarder = Forwarder(config.token)
        for sub in config.subscriptions:
            self.fleet.add(sub.endpoint, sub.name, replay=sub.replay, model=sub.model,
                           curve_server_key=sub.curve_server_key)

    # -- HTTP -----------------------------------------------------------------------------
    async def lookup(self, request: Any) -> Any:
        web = need_aiohttp()
        t0 = time.perf_counter()
        answer = self.chooser.answer(parse_query(parse_body(await request.read())))
        server_s = time.perf_counter() - t0
        self.latency.observe(server_s)
        answer["server_time_us"] = round(server_s * 1e6, 1)
        return web.json_response(answer)

    async def prefetch(self, request: Any) -> Any:
        """Choose the instance as `/lookup` would and forward the prefetch to its control URL."""
        web = need_aiohttp()
        body = parse_body(await request.read())
        wait_s = prefetch_wait(body)
        query = parse_query(body)
        if query.lora is not None:
            raise BadRequest("lora_id: a LoRA request cannot be prefetched (its adapter's files enter the keys)")
        best = self.chooser.answer(query)["best"]
        url = self.controls.get(best) if best is not None else None
        if url is None:
            self.forwarder.num_no_control += 1
            why = "no instance to choose" if best is None else f"instance {best!r} has no control URL"
            return web.json_response({"error": why, "instance": best}, status=404 if best is None else 409)
        status, answer = await self.forwarder.forward(url, query, wait_s)
        out = {"instance": best, "forwarded_to": f"{url}/prefetch"}
        if status in (429, 502, 504):
            return web.json_response({**out, "error": answer}, status=status)
        return web.json_response({**out, "instance_status": status, "instance_answer": answer})

    async def register(self, request: Any) -> Any:
        web = need_aiohttp()
        body = parse_body(await request.read())
        known = {"instance_id", "endpoint", "replay_endpoint", "model_name", "block_size", "server_public_key",
                 "control_url"}
        if not isinstance(body, dict) or not isinstance(body.get("endpoint"), str) or set(body) - known:
            raise BadRequest(f"register takes a JSON object with 'endpoint' and optionally {sorted(known)}")
        name, key = body.get("instance_id"), text_field(body, "server_public_key")
        if not isinstance(name, int) or isinstance(name, bool):  # Dynamo numbers its workers
            name = text_field(body, "instance_id")
        try:
            sub = Subscription(body["endpoint"], str(name or ""), body.get("replay_endpoint"),
                               text_field(body, "model_name"), None if key is None else key.encode())
            RouterConfig(subscriptions=(sub,), curve=self.config.curve, limits=self.config.limits)
            control = None if body.get("control_url") is None else check_control_url(body["control_url"])
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        try:
            src = self.fleet.add(sub.endpoint, sub.name, replay=sub.replay, model=sub.model,
                                 curve_server_key=sub.curve_server_key, registered=True)
        except FleetFull as exc:
            return web.json_response({"error": str(exc)}, status=429)
        src.last_seen = time.monotonic()  # the silence that forgets it counts from now
        self.subscriber.follow(src)
        if control is not None:
            self.controls[sub.name] = control
        return web.json_response({"registered": sub.endpoint, "instance_id": sub.name})

    async def unregister(self, request: Any) -> Any:
        web = need_aiohttp()
        body = parse_body(await request.read())
        if not isinstance(body, dict) or not (isinstance(body.get("endpoint"), str)
                                              or isinstance(body.get("instance_id"), str)):
            raise BadRequest("unregister takes a JSON object with 'endpoint' or 'instance_id'")
        gone = [s.endpoint for s in list(self.fleet.sources.values())
                if s.endpoint == body.get("endpoint") or s.name == body.get("instance_id")]
        for endpoint in gone:
            self.subscriber.drop(endpoint)
            self.fleet.remove(endpoint)
        self._forget_controls()
        return web.json_response({"unregistered": gone}, status=200 if gone else 404)

    async def healthz(self, request: Any) -> Any:
        web = need_aiohttp()
        now = time.monotonic()
        sources = self.fleet.sources.values()
        alive = [s for s in sources if self.fleet.alive(s, now)]
        body = {"status": "ok" if sources else "no instances", "sources": len(sources), "alive": len(alive),
                "synced": sum(1 for s in alive if s.seq is not None and not s.replaying),
                "instances": len(self.fleet.instances())}
        return web.json_response(body, status=200 if sources else 503)

    async def instances(self, request: Any) -> Any:
        web = need_aiohttp()
        now = time.monotonic()
        out: dict[str, Any] = {}
        for name, srcs in self.fleet.instances().items():
            out[name] = {"alive": any(self.fleet.alive(s, now) for s in srcs), "sources": [{
                "endpoint": s.endpoint, "model": s.label, "alive": self.fleet.alive(s, now), "seq": s.seq,
                "block_size": s.block_size, "remote": s.remote[0] if s.remote else None,
                "blocks": {t: self.fleet.index.count(s.slot.index, i) for i, t in enumerate(TIERS)},
                "unmapped_blocks": s.num_unmapped, "bad_messages": s.num_bad} for s in srcs]}
        return web.json_response(out)

    def metrics_text(self) -> str:
        """Prometheus text exposition of the router's metrics (docs/routing.md)."""
        from kvstore.metrics import prometheus

        prom = prometheus()
        if self._registry is None:
            self._registry = prom.CollectorRegistry()
            self._registry.register(RouterCollector(self))
        return str(prom.generate_latest(self._registry).decode())

    async def metrics(self, request: Any) -> Any:
        web = need_aiohttp()
        try:
            text = self.metrics_text()
        except ConfigError as exc:  # prometheus_client is missing
            return web.json_response({"error": str(exc)}, status=501)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _allowed(self, request: Any) -> bool:
        if request.path in _OPEN:
            return True
        if self.config.token is not None:
            return self._gate.check(request.headers.get("Authorization"), request.remote)
        if request.path not in ("/register", "/unregister") or _is_loopback(request.remote):
            return True
        self._gate.refused(request.remote, f"to {request.path}, which answers only loopback clients without a token")
        return False

    async def _expect(self, request: Any) -> None:
        """`Expect: 100-continue`, or a 417 that does not quote the header: aiohttp's own
        handler does, which fails on bytes that are not UTF-8 (a 500, before any middleware)."""
        web = need_aiohttp()
        if request.version != (1, 1):
            return
        if request.headers.get("Expect", "").lower() != "100-continue":
            self.num_bad_requests += 1
            raise web.HTTPExpectationFailed(text="the only Expect header this router takes is 100-continue")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0

    async def _nowhere(self, request: Any) -> Any:
        """Every other path and method (so that `_expect` answers for them too): 404 or 405."""
        web = need_aiohttp()
        if request.path not in _ROUTES:
            raise web.HTTPNotFound()
        raise web.HTTPMethodNotAllowed(request.method, [_ROUTES[request.path]])

    def app(self) -> Any:
        web = need_aiohttp()

        @web.middleware  # type: ignore[untyped-decorator]  # `web` comes from need_aiohttp()
        async def guard(request: Any, handler: Any) -> Any:
            if not self._allowed(request):
                self.num_unauthorized += 1
                return web.json_response({"error": "unauthorized: this router needs its bearer token"}, status=401)
            try:
                return await handler(request)
            except BadRequest as exc:
                self.num_bad_requests += 1
                return web.json_response({"error": str(exc)}, status=400)
            except web.RequestPayloadError as exc:  # e.g. a Content-Encoding its bytes do not decode as
                self.num_bad_requests += 1
                request.content.feed_eof()  # the rest is unreadable: no lingering read (and traceback) after this
                response = web.json_response({"error": f"body cannot be read: {' '.join(str(exc).split())[:200]}"},
                                             status=400)
                response.force_close()
                return response
            except web.HTTPException as exc:
                if exc.status == 413:
                    self.num_bad_requests += 1
                    return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, status=413)
                return web.json_response({"error": exc.reason}, status=exc.status)

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[guard])
        for path, method in _ROUTES.items():  # each path's handler is the method of its name
            add = app.router.add_get if method == "GET" else app.router.add_post
            add(path, getattr(self, path[1:]), expect_handler=self._expect)
        app.router.add_route("*", "/{tail:.*}", self._nowhere, expect_handler=self._expect)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: Any) -> None:
        from router.subscriber import Subscriber

        self.subscriber = Subscriber(self.fleet, self.config.curve, self.config.curve_server_key)
        for src in self.fleet.sources.values():
            self.subscriber.follow(src)
        self._sweeper = asyncio.ensure_future(self._sweep())
        await self.forwarder.start()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for src in self.fleet.sweep(time.monotonic()):
                self.subscriber.drop(src.endpoint)
            self._forget_controls()

    def _forget_controls(self) -> None:
        """Drop the control URLs `/register` gave for instances the router no longer knows
        (those of `--control` stay): they are bounded by the fleet."""
        known = self.fleet.instances()
        for name in [n for n in self.controls if n not in known and n not in dict(self.config.controls)]:
            del self.controls[name]

    async def _stop(self, _: Any) -> None:
        self._sweeper.cancel()
        await asyncio.gather(self._sweeper, return_exceptions=True)
        await self.subscriber.close()
        await self.forwarder.close()


async def _run(router: Router, host: str, port: int, started: Any = None) -> Any:
    """Start serving; returns the aiohttp runner (`cleanup()` stops it). Raises `ConfigError`
    if the address cannot be bound."""
    web = need_aiohttp()
    runner = web.AppRunner(router.app(), access_log=None, logger=_ProtocolLog(router))
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return runner


def serve(config: RouterConfig, host: str, port: int) -> None:
    """Run the router until SIGINT or SIGTERM. Raises `ConfigError` if it cannot bind."""

    async def main() -> None:
        router = Router(config)
        runner = await _run(router, host, port)
        logger.info("kvstrata router listening on http://%s:%d, following %d sources", host, port,
                    len(config.subscriptions))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
