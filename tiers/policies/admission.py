"""Admission: whether a block may be written into a tier at all.

A block used once and never again ("one-hit wonder") costs a write and, on an SSD, endurance;
admission keeps such blocks out. Uses are counted in a TinyLFU frequency sketch (Einziger et
al., TOS'17): a count-min sketch of small saturating counters, all halved every `sample_x`
capacities of additions, so old popularity fades and memory stays a few bytes per block.
Hashing is pure and deterministic: a key's sketch positions are the same in every process.

Rules, each a config class registered by name (`register_admission`, `ADMISSION_RULES`):
`all` admits everything (no sketch); `seen` admits a block once it was used `threshold` times
(vLLM's store threshold); `tinylfu` admits a block only if it was used more often than the
block it would evict (TinyLFU's rule; a tier with room admits everything). The strings
`all`, `seen:N`, `tinylfu` name them too (`AdmissionSpec`); a rule outside kvstrata is named
by a dict `{"type": ..., "module_path": ...}` (`tiers/plugins.py`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Hashable
from dataclasses import dataclass

from tiers.errors import ConfigError
from tiers.plugins import Registry

_ROWS = 4
_MAX = 15  # counters saturate here (4 bits in TinyLFU)
_HALVE = bytes(i >> 1 for i in range(256))  # bytearray.translate table: every counter halved
_MASK64 = (1 << 64) - 1


def key_bits(key: Hashable) -> int:
    """64 deterministic bits of a key: the first 8 bytes of a digest (`BlockHash`), or
    splitmix64 of an int (the trace replay's block ids). Other keys raise `TypeError`."""
    if isinstance(key, bytes):
        return int.from_bytes(key[:8], "little")
    if isinstance(key, int):
        z = (key + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)
    raise TypeError(f"a frequency sketch counts bytes or int keys, not {type(key).__name__}")


class FrequencySketch:
    """Estimated use counts of recently seen keys, never below the true count since the last
    halving (a count-min sketch), saturating at 15.

    `width` counters per row (a power of two, at least the expected number of distinct keys);
    after `sample_x * width` additions every counter is halved.
    """

    def __init__(self, expected_keys: int, *, sample_x: int = 10) -> None:
        if expected_keys <= 0:
            raise ValueError(f"a frequency sketch needs expected_keys > 0, got {expected_keys}")
        width = 16
        while width < expected_keys:
            width *= 2
        self.width = width
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(_ROWS)]
        self._sample = sample_x * width
        self._added = 0
        self.num_halvings = 0

    def _slots(self, key: Hashable) -> tuple[int, int, int, int]:
        h = key_bits(key)
        a, b, m = h & 0xFFFFFFFF, (h >> 32) | 1, self._mask
        return a & m, (a + b) & m, (a + 2 * b) & m, (a + 3 * b) & m

    def add(self, key: Hashable) -> None:
        """Count one use of `key` (only its smallest counters grow: conservative update)."""
        slots = self._slots(key)
        rows = self._rows
        low = min(rows[0][slots[0]], rows[1][slots[1]], rows[2][slots[2]], rows[3][slots[3]])
        if low < _MAX:
            for row, i in zip(rows, slots):
                if row[i] == low:
                    row[i] = low + 1
        self._added += 1
        if self._added >= self._sample:
            self._added //= 2
            self.num_halvings += 1
            for row in rows:
                row[:] = row.translate(_HALVE)

    def estimate(self, key: Hashable) -> int:
        """The estimated use count of `key`; changes nothing."""
        s = self._slots(key)
        r = self._rows
        return min(r[0][s[0]], r[1][s[1]], r[2][s[2]], r[3][s[3]])


class AdmissionKind(str, enum.Enum):
    ALL = "all"
    SEEN = "seen"
    TINYLFU = "tinylfu"


@dataclass(frozen=True)
class AdmissionRule(abc.ABC):
    """An admission rule's config: a frozen dataclass registered by name with
    `register_admission` (`ADMISSION_RULES`), deciding whether a block may enter a tier."""

    @property
    def kind(self) -> str:
        """Its registered name (an `AdmissionKind` for kvstrata's rules)."""
        name = ADMISSION_RULES.name_of(self)
        return AdmissionKind(name) if name in AdmissionKind._value2member_map_ else name

    @property
    def counts_uses(self) -> bool:
        """Whether it needs the tier's uses counted (in a `FrequencySketch`)."""
        return True

    @property
    def needs_victim(self) -> bool:
        """Whether it compares a block with the block its entry would evict (a tier that does
        not know the lower tier's victim cannot run it)."""
        return False

    @abc.abstractmethod
    def admit(self, sketch: FrequencySketch | None, key: Hashable, victim: Hashable | None) -> bool:
        """Whether `key` may enter; `sketch` holds the counted uses (None unless `counts_uses`),
        `victim` is the block its entry would evict (None: the tier has room). Changes nothing."""


ADMISSION_RULES: Registry[AdmissionRule] = Registry("admission rule", AdmissionRule, ("tiers.policies.admission",))
register_admission = ADMISSION_RULES.register


@register_admission("all")
@dataclass(frozen=True)
class AdmitAll(AdmissionRule):
    """Everything is admitted; no use is counted."""

    @property
    def counts_uses(self) -> bool:
        return False

    def admit(self, sketch: FrequencySketch | None, key: Hashable, victim: Hashable | None) -> bool:
        return True


@register_admission("seen")
@dataclass(frozen=True)
class AdmitSeen(AdmissionRule):
    """A block used at least `threshold` times (2..15) while counted (vLLM's store threshold)."""

    threshold: int = 2

    def __post_init__(self) -> None:
        t = self.threshold
        if not isinstance(t, int) or isinstance(t, bool) or not 2 <= t <= _MAX:
            raise ConfigError(f"AdmitSeen.threshold must be an int in [2, {_MAX}], got {t!r}")

    def admit(self, sketch: FrequencySketch | None, key: Hashable, victim: Hashable | None) -> bool:
        assert sketch is not None  # counts_uses
        return sketch.estimate(key) >= self.threshold


@register_admission("tinylfu")
@dataclass(frozen=True)
class AdmitTinyLFU(AdmissionRule):
    """A block used more often than the block it would evict (TinyLFU's rule)."""

    @property
    def needs_victim(self) -> bool:
        return True

    def admit(self, sketch: FrequencySketch | None, key: Hashable, victim: Hashable | None) -> bool:
        assert sketch is not None  # counts_uses
        return victim is None or sketch.estimate(key) > sketch.estimate(victim)


@dataclass(frozen=True)
class AdmissionSpec(AdmissionRule):
    """A rule as its string names it: `all`, `seen:N` (N >= 2) or `tinylfu` (`parse_admission`)."""

    kind: AdmissionKind = AdmissionKind.ALL  # a field where other rules have a property
    threshold: int = 0  # for SEEN: uses needed

    def __str__(self) -> str:
        return f"seen:{self.threshold}" if self.kind is AdmissionKind.SEEN else self.kind.value

    @property
    def rule(self) -> AdmissionRule:
        """The registered rule it names."""
        if self.kind is AdmissionKind.SEEN:
            return AdmitSeen(self.threshold)
        return AdmitTinyLFU() if self.kind is AdmissionKind.TINYLFU else AdmitAll()

    @property
    def counts_uses(self) -> bool:
        return self.rule.counts_uses

    @property
    def needs_victim(self) -> bool:
        return self.rule.needs_victim

    def admit(self, sketch: FrequencySketch | None, key: Hashable, victim: Hashable | None) -> bool:
        return self.rule.admit(sketch, key, victim)


ADMIT_ALL = AdmissionSpec()


def parse_admission(value: AdmissionRule | str, name: str = "admission") -> AdmissionRule:
    """`value` as a rule: a rule as it is, a string as an `AdmissionSpec`; `ConfigError`
    naming `name` and the forms otherwise."""
    if isinstance(value, AdmissionRule):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("all", "tinylfu"):
        return AdmissionSpec(AdmissionKind(text))
    if text is not None and text.startswith("seen:") and text[5:].isdigit() and 2 <= int(text[5:]) <= 15:
        return AdmissionSpec(AdmissionKind.SEEN, int(text[5:]))
    raise ConfigError(f"{name} must be 'all', 'tinylfu' or 'seen:N' with N in [2, 15], got {value!r}")


def admission_rule(value: object, what: str = "admission") -> AdmissionRule:
    """`value` as a rule: an `AdmissionRule`, a string `parse_admission` reads, a registered
    name, or a dict with its `type` (`tiers/plugins.py`); `ConfigError` naming `what` otherwise."""
    if isinstance(value, str):
        try:
            return parse_admission(value, what)
        except ConfigError:
            if value not in ADMISSION_RULES.names():
                raise
    return ADMISSION_RULES.config_from(value, what=what)


class Admission:
    """Counts uses (`record`) and answers whether a block may enter a tier (`admit`), by its
    rule (`spec`).

    Counters `num_admitted` / `num_refused` count the answers. A rule that counts no uses
    (`all`) records nothing.
    """

    def __init__(self, spec: AdmissionRule | str, expected_keys: int) -> None:
        self.spec = parse_admission(spec)
        self.sketch = FrequencySketch(expected_keys) if self.spec.counts_uses else None
        self.num_admitted = 0
        self.num_refused = 0

    @property
    def admits_all(self) -> bool:
        return self.sketch is None

    def record(self, key: Hashable) -> None:
        """Count one use of `key`."""
        if self.sketch is not None:
            self.sketch.add(key)

    def admit(self, key: Hashable, victim: Hashable | None = None) -> bool:
        """Whether `key` may enter; `victim` is the block its entry would evict (None: the tier
        has room). Counts the answer; changes no use count."""
        ok = self.spec.admit(self.sketch, key, victim)
        if ok:
            self.num_admitted += 1
        else:
            self.num_refused += 1
        return ok
