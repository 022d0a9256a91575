"""The KV-event publisher a `StoreConfig` asks for, fed by a tier stack's changes.

Each tier's medium comes from its traits (`kvevents.medium_of`); a tier that persists keys (a
disk) is read once, here, so that a restarted store announces what it still holds; a shared
tier names itself by its identity. The publisher is one sink of the stack's change feed, and
pulls the feed itself every 20 ms (what tiers do in the background). Nothing here needs the
store's lock.
"""

from __future__ import annotations

import os
import socket
import threading

import xxhash

from kvevents import EventPublisher, EventSource, medium_of, new_epoch, publisher_config
from kvstore.config import StoreConfig
from kvstore.hashing import BlockHash
from kvstore.tier_stack import TierStack
from tiers.keys import BlockKey


def open_publisher(config: StoreConfig, seed: BlockHash, stack: TierStack, lock: threading.RLock) -> EventPublisher:
    """Start publishing `config.events_endpoint`: every change of the stack's tiers goes to
    the publisher from now on. Raises `ConfigError` if the endpoint cannot be bound (nothing
    is wired then).

    The publisher's own pull (for background writes) takes the changes only while no store
    call holds `lock`: a call in progress may have recorded a demoted block's arrival below
    before its parent's arrival above, and publishes both itself when it ends."""
    assert config.events_endpoint is not None
    tiers = stack.tiers
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
    stack.changes.publish()  # what opening the tiers did is in the warm state already
    def pull() -> None:
        if lock.acquire(blocking=False):
            try:
                stack.changes.publish()
            finally:
                lock.release()

    publisher = EventPublisher(pub_config, source, media, warm, poll=pull)
    stack.changes.add_sink(publisher.publish)
    return publisher
