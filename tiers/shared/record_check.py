"""The verdict on a record a shared tier fetched: checked as its key's and copied out, or a
miss, counted and warned of; the tier removes a damaged one.

The remote, Mooncake and shared-filesystem tiers read records other hosts wrote
(`tiers/shared/record.py`). A sound record this reader cannot check or decode
(`UnverifiableRecordError`) is counted in `num_unverifiable` and left in place; a damaged one
(`CorruptRecordError`, or a value the tier refused unread) is counted in the tier's
`counters.num_corrupt` and handed to the tier's own removal. Each with a rate-limited warning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from tiers.base import TierCounters
from tiers.errors import CorruptRecordError, UnverifiableRecordError
from tiers.keys import BlockKey
from tiers.shared.forks import renew_in_child
from tiers.shared.ratelimit import RateLimitedWarning
from tiers.shared.record import Payload, RecordCodec, header_ends

T = TypeVar("T")
OnDamaged = Callable[[], object]  # removes the damaged record (or notes it, to be removed)


class RecordCheck:
    """Validates one tier's fetched records with `codec`, counting and warning of each that
    fails (`where` names the tier in warnings; `damaged` is the warning's text for a damaged
    record, its `{}` the reason). Thread-safe (a read's lanes or threads count at once)."""

    def __init__(self, codec: RecordCodec, counters: TierCounters, warn: RateLimitedWarning, *, where: str,
                 damaged: str = "a damaged record ({}); removed, a miss") -> None:
        self.codec = codec
        self.num_unverifiable = 0
        self._counters = counters
        self._warn = warn
        self._where = where
        self._damaged = damaged
        self._lock = threading.Lock()
        renew_in_child(self, "_lock")

    def take(self, value: memoryview, key: BlockKey, dst: torch.Tensor, on_damaged: OnDamaged) -> bool:
        """Validate `value` as `key`'s record and copy its payload into `dst`; False (a
        counted, warned miss) if it fails, `on_damaged()` called if it is damaged."""
        payload = self.decode(value, key, on_damaged)
        return payload is not None and self.copy_out(payload, dst, on_damaged)

    def take_landed(self, head: memoryview, tail: Sequence[memoryview], key: BlockKey, dst: torch.Tensor,
                    on_damaged: OnDamaged) -> bool:
        """`take` of a record received as `head` and then `tail`, `dst`'s own bytes
        (`RecordCodec.landing`): a raw payload is checked where it landed, with no copy. A
        record laid out otherwise (its header not ending `head`; an encoded payload) is
        joined into one buffer first, then taken. On False `dst` holds anything."""
        if not header_ends(head):  # not a header, then a raw payload of this size: taken whole
            return self.take(memoryview(b"".join((head, *tail))), key, dst, on_damaged)
        codec_id = self._judged(lambda: self.codec.decode_landed(head, tail, key), on_damaged)
        if codec_id is None:
            return False
        if codec_id:  # an encoded payload of a block's size: decoded from a copy, never over itself
            return self.copy_out(Payload(memoryview(b"".join(tail)), codec_id), dst, on_damaged)
        return True

    def decode(self, value: memoryview | bytes, key: BlockKey, on_damaged: OnDamaged) -> Payload | None:
        """`value` validated as `key`'s record: its payload, or None (as `take`)."""
        return self._judged(lambda: self.codec.decode(value, key), on_damaged)

    def copy_out(self, payload: Payload, dst: torch.Tensor, on_damaged: OnDamaged) -> bool:
        """A `decode`d payload written into `dst`; False (as `take`) if it does not decode."""
        def run() -> bool:
            self.codec.copy_out(payload, dst)
            return True

        return self._judged(run, on_damaged) is not None

    def _judged(self, check: Callable[[], T], on_damaged: OnDamaged) -> T | None:
        try:
            return check()
        except UnverifiableRecordError as exc:
            with self._lock:
                self.num_unverifiable += 1
            self._warn(f"{self._where}: {exc}; a miss")
        except CorruptRecordError as exc:
            self.damaged(str(exc), on_damaged)
        return None

    def damaged(self, why: str, on_damaged: OnDamaged | None = None) -> None:
        """Count a damaged record (`why`), warn, then `on_damaged()` (its removal)."""
        with self._lock:
            self._counters.num_corrupt += 1
        self._warn(f"{self._where}: {self._damaged.format(why)}")
        if on_damaged is not None:
            on_damaged()


class ChecksRecords:
    """A tier whose fetched records its `RecordCheck`, `_checks`, judges."""

    _checks: RecordCheck

    @property
    def num_unverifiable(self) -> int:
        """Sound records read that this reader could not check or decode (left in place)."""
        return self._checks.num_unverifiable
