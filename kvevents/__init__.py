"""KV events as a service of their own: the publisher a store announces its tiers' changes
through (`publisher.py`, over its mirror, `mirror.py`), vLLM's wire format (`wire.py`), CURVE
authentication (`auth.py`) and per-peer rate limits (`ratelimit.py`).

It knows tiers only by their changes (`tiers.changes.TierChange`) and traits; the store wires
it to its tier stack (`kvstore/events_setup.py`), and readers (`router/`) import these names.
"""

from kvevents.auth import CurveClient, CurveServer, check_public_key, load_keypair, load_public
from kvevents.config import EventSource, PublisherConfig, new_epoch, publisher_config
from kvevents.publisher import EventPublisher
from kvevents.ratelimit import TokenBuckets
from kvevents.wire import (
    END_SEQ,
    MAX_MESSAGE_BYTES,
    MEDIA,
    BadPayload,
    check_endpoint,
    check_events,
    default_replay_endpoint,
    medium_of,
    unpack_peer,
    vllm_extras,
    wire_hash,
)

__all__ = [
    "END_SEQ",
    "MAX_MESSAGE_BYTES",
    "MEDIA",
    "BadPayload",
    "CurveClient",
    "CurveServer",
    "EventPublisher",
    "EventSource",
    "PublisherConfig",
    "TokenBuckets",
    "check_endpoint",
    "check_events",
    "check_public_key",
    "default_replay_endpoint",
    "load_keypair",
    "load_public",
    "medium_of",
    "new_epoch",
    "publisher_config",
    "unpack_peer",
    "vllm_extras",
    "wire_hash",
]
