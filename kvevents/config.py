"""Who publishes KV events and how: the source every event names, and the publisher's
endpoints, topic and CURVE keys (from a store's `events_*` settings, validated there)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from kvevents.auth import CurveServer
from kvevents.wire import default_replay_endpoint


@dataclass(frozen=True)
class EventSource:
    """Who publishes: what goes into every event's "kvstrata" map, and the chain root."""

    instance_id: str
    model: str
    seed: bytes
    block_size: int
    remote: str | None
    namespace_id: str  # a fingerprint of the namespace seed (never the seed itself)
    epoch: int

    def meta(self) -> dict[str, Any]:
        return {"instance": self.instance_id, "model": self.model, "epoch": self.epoch, "remote": self.remote,
                "ns": self.namespace_id, "block_size": self.block_size}


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how a store publishes (from `StoreConfig.events_*`)."""

    endpoint: str
    replay_endpoint: str | None
    topic: bytes = b""
    curve: CurveServer | None = None
    max_mirror_blocks: int = 1 << 20
    connect: bool = False  # connect to `endpoint` (a reader that binds, as llm-d's indexer) instead of binding



def publisher_config(endpoint: str, replay: str | None, topic: str, curve_cert: str | None,
                     curve_clients: str | None, max_mirror_blocks: int, connect: bool = False) -> PublisherConfig:
    """A `PublisherConfig` from store settings (validated there). Connecting, the publisher
    answers replays only where `replay` names an endpoint to bind."""
    curve = CurveServer.from_files(curve_cert, curve_clients) if curve_cert and curve_clients else None
    if replay is None and not connect:
        replay = default_replay_endpoint(endpoint)
    return PublisherConfig(endpoint, replay, topic.encode(), curve, max(1, max_mirror_blocks), connect)


def new_epoch() -> int:
    """A fresh publisher epoch: readers take a new one as a restart of its source."""
    return secrets.randbits(62)
