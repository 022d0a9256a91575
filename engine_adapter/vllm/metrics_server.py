"""Serve a worker store's Prometheus metrics on `metrics_port` (one HTTP server per process).

vLLM's own `/metrics` lives in its API server process, which is not the process holding the
worker's store, so the connector serves its own: `kvstrata_*` series with `tier` labels
(docs/metrics.md). A port that cannot be bound is a warning, never a failed engine.
"""

from __future__ import annotations

import logging
import threading

from kvstore import KVCacheStore
from kvstore.errors import ConfigError
from kvstore.metrics import register_metrics

logger = logging.getLogger(__name__)
_LOCK = threading.Lock()
_SERVED: dict[int, object] = {}  # port -> the registry served there


def serve_metrics(store: KVCacheStore, port: int, host: str = "127.0.0.1") -> bool:
    """Register `store`'s metrics and serve them on `host:port` (once per process and port;
    loopback by default);
    False, with a warning, if the extra is missing or the port cannot be bound."""
    try:
        import prometheus_client
    except ImportError:
        logger.warning("kvstrata: metrics_port=%d needs prometheus_client: pip install 'kvstrata[metrics]'", port)
        return False
    with _LOCK:
        registry = _SERVED.get(port)
        if registry is None:
            registry = prometheus_client.CollectorRegistry()
            try:
                prometheus_client.start_http_server(port, addr=host, registry=registry)
            except OSError as exc:
                logger.warning("kvstrata: cannot serve metrics on port %d: %s", port, exc)
                return False
            _SERVED[port] = registry
        try:
            register_metrics(store, registry)
        except (ConfigError, ValueError) as exc:  # already registered (a shared store)
            logger.debug("kvstrata: metrics of this store already served: %s", exc)
    return True
