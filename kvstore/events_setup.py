"""The KV-event publisher a `StoreConfig` asks for, wired to a stack's tiers.

Each tier's medium comes from its traits (`events_wire.medium_of`); a tier that persists keys
(a disk) is read once, here, so that a restarted store announces what it still holds; a
shared tier names itself by its identity. Nothing here needs the store's lock.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence

import xxhash

from kvstore.config import StoreConfig
from kvstore.events import EventPublisher, EventSource, PublisherConfig
from kvstore.events_auth import CurveServer
from kvstore.events_wire import default_replay_endpoint, medium_of
from kvstore.hashing import BlockHash
from kvstore.keying import Keyer
from tiers.base import BlockKey, Tier


def open_publisher(config: StoreConfig, seed: BlockHash, tiers: Sequence[Tier], keyer: Keyer) -> EventPublisher:
    """Start publishing `config.events_endpoint`: every tier reports its changes to the
    publisher from now on, and the keyer describes the blocks it keys. Raises `ConfigError`
    if the endpoint cannot be bound (nothing is wired then)."""
    assert config.events_endpoint is not None
    media = {tier.kind: medium_of(tier.traits) for tier in tiers}
    warm: list[tuple[BlockKey, str]] = []
    for tier in tiers:
        if tier.traits.persistent and not tier.traits.shared:
            warm.extend((key, media[tier.kind]) for key in tier.held_keys())
    shared = [t.identity for t in tiers if t.traits.shared and t.identity is not None]
    source = EventSource(
        instance_id=config.instance_id or f"{socket.gethostname()}:{os.getpid()}",
        model=config.model_name or config.namespace[:128], seed=bytes(seed), block_size=config.block_size,
        remote=shared[0] if shared else None, namespace_id=xxhash.xxh3_64_hexdigest(bytes(seed)), epoch=new_epoch())
    capacity = sum(t.capacity_blocks for t in tiers if not t.traits.shared)
    pub_config = publisher_config(config.events_endpoint, config.events_replay_endpoint, config.events_topic,
                                  config.events_curve_cert, config.events_curve_clients,
                                  min(capacity + (1 << 16), 1 << 22), config.events_connect)
    publisher = EventPublisher(pub_config, source, media, warm)
    for tier in tiers:
        tier.listener = publisher.on_change
        tier.describe = publisher.complete
    keyer.on_keys = publisher.describe
    return publisher


def new_epoch() -> int:
    return secrets.randbits(62)


def publisher_config(endpoint: str, replay: str | None, topic: str, curve_cert: str | None,
                     curve_clients: str | None, max_mirror_blocks: int, connect: bool = False) -> PublisherConfig:
    """A `PublisherConfig` from store settings (validated there). Connecting, the publisher
    answers replays only where `replay` names an endpoint to bind."""
    curve = CurveServer.from_files(curve_cert, curve_clients) if curve_cert and curve_clients else None
    if replay is None and not connect:
        replay = default_replay_endpoint(endpoint)
    return PublisherConfig(endpoint, replay, topic.encode(), curve, max(1, max_mirror_blocks), connect)
