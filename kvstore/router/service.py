"""`kvstrata router`: the HTTP service (aiohttp) over a `FleetView` fed by ZeroMQ subscriptions.

Endpoints: `POST /lookup` (see `kvstore.router.lookup`), `GET /healthz`, `GET /instances`
(what the router knows of each instance) and `GET /metrics` (Prometheus text). One event
loop owns the index: subscriptions, snapshot fetches and lookups never run concurrently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvstore.errors import ConfigError
from kvstore.events import SNAPSHOT_REQUEST, TOPIC, check_endpoint, snapshot_endpoint
from kvstore.router.fleet import FleetView, Instance
from kvstore.router.index import TIER_BIT, TIERS
from kvstore.router.lookup import BadRequest, Chooser, Scoring, parse_query

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20
SNAPSHOT_TIMEOUT_S = 10.0
_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


def _need_aiohttp() -> Any:
    try:
        from aiohttp import web
    except ImportError:
        raise ConfigError("kvstrata router needs aiohttp: pip install 'kvstrata[router]'") from None
    return web


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens and what it subscribes to.

    Attributes:
        subscribe: kvstrata events endpoints (a store's `events_endpoint`).
        vllm_events: instance id -> the endpoint where that instance's vLLM publishes its own
            KV events (`--kv-events-config`), mapped onto the instance's kvstrata keys.
        scoring: how `best` is chosen.
        stale_after_s: an instance silent this long (no heartbeat) is not a candidate.
    """

    subscribe: tuple[str, ...] = ()
    vllm_events: tuple[tuple[str, str], ...] = ()
    scoring: Scoring = field(default_factory=Scoring)
    stale_after_s: float = 5.0

    def __post_init__(self) -> None:
        for endpoint in self.subscribe:
            check_endpoint(endpoint, "--subscribe")
        for instance_id, endpoint in self.vllm_events:
            check_endpoint(endpoint, f"--vllm-events {instance_id}=")
        if not self.subscribe:
            raise ConfigError("the router needs at least one --subscribe ENDPOINT")
        if not 0 < self.stale_after_s < 3600:
            raise ConfigError(f"stale_after_s must be in (0, 3600), got {self.stale_after_s!r}")


class Router:
    """The service's state and handlers; `serve` runs it on a loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.fleet = FleetView(stale_after_s=config.stale_after_s)
        self.chooser = Chooser(self.fleet, config.scoring)
        self.num_lookups = self.num_bad_requests = 0
        self._latency_counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: Any = None
        self._registry: Any = None

    # -- subscriptions --------------------------------------------------------------------
    async def _subscribe(self, endpoint: str) -> None:
        import zmq
        import zmq.asyncio

        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.connect(endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    if len(frames) != 3 or frames[0] != TOPIC or len(frames[1]) != 8:
                        raise ValueError(f"{len(frames)} frames")
                    payload = msgpack.unpackb(frames[2], raw=False)
                    if not isinstance(payload, dict):
                        raise ValueError("payload is not a map")
                except (ValueError, msgpack.UnpackException) as exc:
                    self.fleet.num_bad_messages += 1
                    logger.debug("kvstrata router: bad message from %s: %s", endpoint, exc)
                    continue
                inst = self.fleet.on_batch(int.from_bytes(frames[1], "big"), payload, endpoint)
                if inst is not None:
                    self._tasks.append(asyncio.ensure_future(self._fetch_snapshot(inst)))
                    self._tasks = [t for t in self._tasks if not t.done()]
        finally:
            sock.close(linger=0)

    async def _fetch_snapshot(self, inst: Instance) -> None:
        import zmq

        assert inst.endpoint is not None
        where = snapshot_endpoint(inst.endpoint)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(where)
        try:
            await sock.send(SNAPSHOT_REQUEST)
            frames = await asyncio.wait_for(sock.recv_multipart(), SNAPSHOT_TIMEOUT_S)
            if len(frames) != 3 or frames[0] != SNAPSHOT_REQUEST:
                raise ValueError(f"unexpected reply of {len(frames)} frames")
            payload = msgpack.unpackb(frames[2], raw=False)
            if not isinstance(payload, dict):
                raise ValueError("payload is not a map")
            self.fleet.apply_snapshot(int.from_bytes(frames[1], "big"), payload)
        except (asyncio.TimeoutError, ValueError, msgpack.UnpackException) as exc:
            inst.snapshot_asked = None  # the next batch asks again
            logger.warning("kvstrata router: snapshot of %s from %s failed: %s", inst.source.instance_id, where,
                           exc or type(exc).__name__)
        finally:
            sock.close(linger=0)

    async def _subscribe_vllm(self, instance_id: str, endpoint: str) -> None:
        import zmq

        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    payload = msgpack.unpackb(frames[-1], raw=False)
                except (ValueError, msgpack.UnpackException):
                    self.fleet.num_bad_messages += 1
                    continue
                self.fleet.on_vllm_batch(instance_id, payload)
        finally:
            sock.close(linger=0)

    def start_subscriptions(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        for endpoint in self.config.subscribe:
            self._tasks.append(asyncio.ensure_future(self._subscribe(endpoint)))
        for instance_id, endpoint in self.config.vllm_events:
            self._tasks.append(asyncio.ensure_future(self._subscribe_vllm(instance_id, endpoint)))

    async def stop_subscriptions(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- HTTP -----------------------------------------------------------------------------
    def _observe(self, seconds: float) -> None:
        self.num_lookups += 1
        self._latency_sum += seconds
        for i, bound in enumerate(_LATENCY_BUCKETS):
            if seconds <= bound:
                self._latency_counts[i] += 1
                break
        else:
            self._latency_counts[-1] += 1

    async def lookup(self, request: Any) -> Any:
        web = _need_aiohttp()
        t0 = time.perf_counter()
        try:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest(f"body is not JSON: {exc}") from None
            answer = self.chooser.answer(parse_query(body))
        except BadRequest as exc:
            self.num_bad_requests += 1
            return web.json_response({"error": str(exc)}, status=400)
        server_s = time.perf_counter() - t0
        self._observe(server_s)
        answer["server_time_us"] = round(server_s * 1e6, 1)
        return web.json_response(answer)

    async def healthz(self, request: Any) -> Any:
        web = _need_aiohttp()
        alive = self.fleet.candidates(None)
        return web.json_response({"status": "ok", "instances": len(self.fleet.instances), "alive": len(alive),
                                  "synced": sum(1 for i in alive if i.synced)})

    async def instances(self, request: Any) -> Any:
        web = _need_aiohttp()
        out = {}
        for inst in self.fleet.instances.values():
            out[inst.source.instance_id] = {
                "model": inst.source.model, "alive": self.fleet.alive(inst), "synced": inst.synced,
                "seq": inst.seq, "block_size": inst.source.block_size, "remote": inst.source.remote,
                "blocks": {t: self.fleet.index.count(inst.slot, TIER_BIT[t]) for t in TIERS[:3]},
                "vllm_gpu_blocks": len(inst.vllm_blocks),
            }
        return web.json_response(out)

    def metrics_text(self) -> str:
        """Prometheus text exposition of the router's metrics (docs/routing.md)."""
        from kvstore.metrics import prometheus

        prom = prometheus()
        if self._registry is None:
            self._registry = prom.CollectorRegistry()
            self._registry.register(_RouterCollector(self))
        return str(prom.generate_latest(self._registry).decode())

    async def metrics(self, request: Any) -> Any:
        web = _need_aiohttp()
        try:
            text = self.metrics_text()
        except ConfigError as exc:  # prometheus_client is missing
            return web.json_response({"error": str(exc)}, status=501)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def app(self) -> Any:
        web = _need_aiohttp()

        @web.middleware  # type: ignore[untyped-decorator]  # `web` comes from _need_aiohttp()
        async def errors(request: Any, handler: Any) -> Any:
            try:
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status == 413:
                    return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, status=413)
                return web.json_response({"error": exc.reason}, status=exc.status)

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors])
        app.router.add_post("/lookup", self.lookup)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/instances", self.instances)
        app.router.add_get("/metrics", self.metrics)

        async def on_startup(_: Any) -> None:
            self.start_subscriptions()

        async def on_cleanup(_: Any) -> None:
            await self.stop_subscriptions()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app


class _RouterCollector:
    """Reads the router's counters at scrape time (a prometheus_client custom collector)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        r, fleet = self.router, self.router.fleet
        for name, text, value in (
            ("kvstrata_router_lookups", "Lookups answered.", r.num_lookups),
            ("kvstrata_router_bad_requests", "Lookups refused with 400.", r.num_bad_requests),
            ("kvstrata_router_event_batches", "KV event batches received.", fleet.num_batches),
            ("kvstrata_router_resyncs", "Snapshots requested (restart, gap or late join).", fleet.num_resyncs),
            ("kvstrata_router_bad_messages", "Malformed event messages ignored.", fleet.num_bad_messages),
            ("kvstrata_router_vllm_unmapped_blocks", "vLLM GPU blocks not mappable to kvstrata keys.",
             fleet.num_vllm_unmapped),
        ):
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("kvstrata_router_indexed_blocks", "Distinct blocks in the index.",
                                value=len(fleet.index))
        alive = len(fleet.candidates(None))
        instances = GaugeMetricFamily("kvstrata_router_instances", "Instances known, by state.", labels=["state"])
        instances.add_metric(["alive"], alive)
        instances.add_metric(["stale"], len(fleet.instances) - alive)
        yield instances
        buckets, cumulative = [], 0
        for bound, count in zip((*_LATENCY_BUCKETS, float("inf")), r._latency_counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("kvstrata_router_lookup_seconds", "Server time of a lookup.",
                                    buckets=buckets, sum_value=r._latency_sum)


def serve(config: RouterConfig, host: str, port: int) -> None:
    """Run the router until interrupted."""
    web = _need_aiohttp()
    router = Router(config)
    logger.info("kvstrata router on http://%s:%d, subscribed to %s", host, port, ", ".join(config.subscribe))
    web.run_app(router.app(), host=host, port=port, print=None, access_log=None)


class RouterThread:
    """The router on a background thread (for demos and benchmarks); `stop()` ends it."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.router = Router(config)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port = port
        self._host = host
        self._thread = threading.Thread(target=self._run, name="kvstrata-router", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        web = _need_aiohttp()
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.router.app(), access_log=None)
        try:
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self._host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def parse_vllm_events(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`ID=ENDPOINT` pairs of `--vllm-events`."""
    out = []
    for value in values:
        instance_id, sep, endpoint = value.partition("=")
        if not sep or not instance_id:
            raise ConfigError(f"--vllm-events must be INSTANCE_ID=ENDPOINT, got {value!r}")
        out.append((instance_id, endpoint))
    return tuple(out)
