"""The router's Prometheus metrics, read at scrape time (a prometheus_client collector)."""

from __future__ import annotations

import time
from typing import Any

LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.num = 0

    def observe(self, seconds: float) -> None:
        self.num += 1
        self.total += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1


class RouterCollector:
    """Yields the router's counters and gauges."""

    def __init__(self, router: Any) -> None:
        self.router = router

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        r, fleet = self.router, self.router.fleet
        for name, text, value in (
            ("kvstrata_router_lookups", "Lookups answered.", r.latency.num),
            ("kvstrata_router_bad_requests", "Requests refused with 4xx.", r.num_bad_requests),
            ("kvstrata_router_unauthorized", "Requests without the router's token.", r.num_unauthorized),
            ("kvstrata_router_event_batches", "KV event batches received.", fleet.num_batches),
            ("kvstrata_router_bad_messages", "Malformed event messages dropped.", fleet.num_bad_messages),
            ("kvstrata_router_bad_events", "Malformed or unusable events dropped.", fleet.num_bad_events),
            ("kvstrata_router_unmapped_blocks", "Blocks left out of the index (unknown parent, extra keys a "
             "lookup cannot express, an unsupported block size).", fleet.num_unmapped),
            ("kvstrata_router_dropped_blocks", "Blocks past the bound on blocks per source.", fleet.num_dropped_blocks),
            ("kvstrata_router_gaps", "Skipped batch numbers.", fleet.num_gaps),
            ("kvstrata_router_replays", "Replays requested.", fleet.num_replays),
            ("kvstrata_router_restarts", "Publisher restarts seen.", fleet.num_restarts),
            ("kvstrata_router_forgotten", "Sources forgotten after a long silence.", fleet.num_forgotten),
            ("kvstrata_router_prefetch_forwarded", "Prefetches forwarded to an instance that answered.",
             r.forwarder.num_forwarded),
            ("kvstrata_router_prefetch_failed", "Prefetches whose instance failed (502).", r.forwarder.num_failed),
            ("kvstrata_router_prefetch_timeouts", "Prefetches whose instance did not answer in time (504).",
             r.forwarder.num_timeouts),
            ("kvstrata_router_prefetch_no_control", "Prefetches with no instance, or no control URL for it.",
             r.forwarder.num_no_control),
            ("kvstrata_router_prefetch_busy", "Prefetches refused (429): too many forwards waited on instances.",
             r.forwarder.num_busy),
            ("kvstrata_router_throttled", "Messages dropped over their source's budget (bytes, or restarts "
             "and clears, a second).", fleet.num_throttled),
        ):
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("kvstrata_router_indexed_blocks", "Distinct blocks in the index.",
                                value=len(fleet.index))
        now = time.monotonic()
        alive = sum(1 for s in fleet.sources.values() if fleet.alive(s, now))
        sources = GaugeMetricFamily("kvstrata_router_sources", "Event sources, by state.", labels=["state"])
        sources.add_metric(["alive"], alive)
        sources.add_metric(["stale"], len(fleet.sources) - alive)
        yield sources
        buckets, cumulative = [], 0
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), r.latency.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("kvstrata_router_lookup_seconds", "Server time of a lookup.",
                                    buckets=buckets, sum_value=r.latency.total)
