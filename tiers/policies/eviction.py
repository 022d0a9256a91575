"""Eviction policies: the order in which a tier gives up its evictable blocks.

A policy holds keys only (never bytes), and only the keys its tier may evict now: the tier
takes a pinned block out (`remove`) and puts it back when unpinned. Every operation is O(1)
amortised. Keys are any hashable value: a tier's `BlockHash`, or an int block id in the trace
replay (`bench/trace_sim.py`), which drives these same classes.

Two kinds of use reach a policy. `access` is a new use of a held key (a hit, or a request that
stores it again); `refresh` is the same use seen again by another call of one request (the
store reads a prefix, promotes it and stores it: three calls, one use). Frequency-counting
policies count only `access`; both make the key recent. `bench trace --policy` measures every
policy here against plain LRU and Belady's optimum on the Mooncake traces (docs/performance.md).

Each policy registers a config class of its own by name beside it (`register_eviction`,
`EVICTION_POLICIES`): `lru` here, `s3fifo`, `arc` and `lfu` in their files; a tier names one as
a name, a config object, or a dict `{"type": ..., "module_path": ...}` for a policy outside
kvstrata (`tiers/plugins.py`).
"""

from __future__ import annotations

import abc
import enum
import functools
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Generic, TypeVar

from tiers.errors import ConfigError
from tiers.plugins import Registry
from tiers.policies.history import History, trim

K = TypeVar("K", bound=Hashable)


class EvictionKind(str, enum.Enum):
    """The eviction policies a tier can run."""

    LRU = "lru"  # least recently used first
    S3FIFO = "s3fifo"  # a small probation FIFO, a main FIFO with reinsertion, ghosts of the small one
    ARC = "arc"  # adaptive split between once-used and reused keys, steered by ghosts of both
    LFU = "lfu"  # least frequently used first (saturating, aged counts), LRU among equals


def parse_eviction(value: EvictionKind | str, name: str = "eviction") -> EvictionKind:
    """`value` as an `EvictionKind`; `ConfigError` naming `name` and the choices otherwise."""
    try:
        return EvictionKind(value)
    except ValueError:
        raise ConfigError(f"{name} must be one of {[k.value for k in EvictionKind]}, got {value!r}") from None


class EvictionPolicy(abc.ABC, Generic[K]):
    """The evictable keys of one tier, in the order they leave it.

    Invariant: `len(self)` keys are held; a key is held from `insert` until `pop` or `remove`
    returns it. Callers insert only keys not held, and access, refresh or remove only held
    keys (a `KeyError` otherwise). `pop` may reorder keys on its way (second chances) and may
    remember the key it returns (a ghost) to judge it when it is inserted again.
    """

    kind: ClassVar[EvictionKind]
    counts_uses: ClassVar[bool] = True  # False where `access` and `refresh` are the same

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"an eviction policy needs a capacity > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of keys held."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is held."""

    @abc.abstractmethod
    def insert(self, key: K) -> None:
        """Hold a key not held (a block entering the tier, or returning from a pin)."""

    @abc.abstractmethod
    def access(self, key: K) -> None:
        """A new use of a held key: counts towards its frequency and makes it recent."""

    @abc.abstractmethod
    def refresh(self, key: K) -> None:
        """The same use of a held key seen again: makes it recent, counts nothing."""

    def refresher(self) -> Callable[[K], None]:
        """`refresh` as the cheapest callable this policy has (a bound C method for LRU), for
        loops over many keys."""
        return self.refresh

    def inserter(self) -> Callable[[K], None]:
        """`insert` as the cheapest callable this policy has."""
        return self.insert

    @abc.abstractmethod
    def remove(self, key: K) -> None:
        """Stop holding `key` without evicting it (a pin, a discard). A policy with a history
        may keep the key's count in it, so that an unpinned key comes back as it left."""

    @abc.abstractmethod
    def pop(self) -> K:
        """Stop holding and return the next key to evict. `IndexError` when none is held."""

    def pop_many(self, num: int) -> list[K]:
        """`pop` `num` times; the keys in the order popped."""
        return [self.pop() for _ in range(num)]

    @abc.abstractmethod
    def restore(self, key: K) -> None:
        """Undo the `pop` that returned `key`: held again, next to be evicted, with whatever
        the pop remembered of it forgotten. Used when the eviction could not be carried out."""

    def deprioritize(self, key: K) -> None:
        """Make a held key the next to evict (the cold end, its use counts forgotten): a
        low-priority block. This default (for policies outside kvstrata) takes it out and
        `restore`s it, the closest the protocol offers; the built-in policies override it."""
        self.remove(key)
        self.restore(key)

    @abc.abstractmethod
    def order(self) -> Iterator[K]:
        """The held keys, roughly in eviction order (the next to go first); changes nothing."""

    def histories(self) -> tuple[History[K, Any], ...]:
        """What it remembers of keys after they left (ghosts, counts); none by default."""
        return ()

    @property
    def num_remembered(self) -> int:
        """Keys remembered after they left (ghosts, counts); 0 for a policy without history."""
        return sum(len(h) for h in self.histories())

    def history_limit(self, capacity_blocks: int) -> int:
        """The most keys this policy remembers for a tier of `capacity_blocks` blocks (never
        more than for its own capacity)."""
        return sum(h.limit_for(capacity_blocks) for h in self.histories())

    def trim_history(self, capacity_blocks: int) -> None:
        """Forget the oldest remembered keys beyond `history_limit(capacity_blocks)`: the
        tier holds fewer blocks under this policy than it was made for (a tenant's share)."""
        for h in self.histories():
            h.trim_to(capacity_blocks)

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget every key, history included."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise `RuntimeError` (a bug) if an internal invariant does not hold."""


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used first: one ordered dict, the first key the oldest."""

    kind = EvictionKind.LRU
    counts_uses = False

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: K) -> None:
        self._order[key] = None

    def access(self, key: K) -> None:
        self._order.move_to_end(key)

    refresh = access

    def refresher(self) -> Callable[[K], None]:
        return self._order.move_to_end

    def inserter(self) -> Callable[[K], None]:
        return self._order.setdefault  # the key is not held: appended, most recent

    def remove(self, key: K) -> None:
        del self._order[key]

    def pop(self) -> K:
        if not self._order:
            raise IndexError("pop from an empty LRU policy")
        return self._order.popitem(last=False)[0]

    def pop_many(self, num: int) -> list[K]:
        if num > len(self._order):
            raise IndexError(f"pop of {num} keys from an LRU policy holding {len(self._order)}")
        popitem = self._order.popitem
        return [popitem(False)[0] for _ in range(num)]

    def restore(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def deprioritize(self, key: K) -> None:
        self._order.move_to_end(key, last=False)

    def order(self) -> Iterator[K]:
        return iter(self._order)

    def clear(self) -> None:
        self._order.clear()

    def check_integrity(self) -> None:
        return None  # one ordered dict: nothing can disagree


def delete_from(key: K, *queues: MutableMapping[K, Any]) -> None:
    """Delete `key` from the first of a policy's `queues` that holds it; `KeyError` if none."""
    for queue in queues:
        if key in queue:
            del queue[key]
            return
    raise KeyError(key)


class ColdQueue(OrderedDict[K, None]):
    """A policy's low-priority keys, the front popped first, and the keys lately popped from
    it, so that `restore` puts them back where they were. It remembers the latest of them up
    to the policy's ghost limit or the most keys the policy held at a pop, whichever is more
    (a small `ghost_x`; a quota tenant's policy holding past its capacity): one eviction may
    pop every held key before it is undone, and each must go back here."""

    def __init__(self, ghost_limit: int) -> None:
        super().__init__()
        self.ghost_limit = ghost_limit
        self._popped: OrderedDict[K, None] = OrderedDict()
        self._most_held = 0

    @property
    def limit(self) -> int:
        """How many popped keys it remembers at most."""
        return max(self.ghost_limit, self._most_held)

    def push_front(self, key: K) -> None:
        """`key` (not held by the policy's other queues) becomes the next to pop."""
        self[key] = None
        self.move_to_end(key, last=False)

    def pop_front(self, held: int) -> K:
        """Take the front key of a policy holding `held` keys (it among them), remembered."""
        self._most_held = max(self._most_held, held)
        key = self.popitem(last=False)[0]
        self._popped[key] = None
        trim(self._popped, self.limit)
        return key

    def unpop(self, key: K) -> bool:
        """Undo `pop_front` of `key`: back at the front; False if it was not popped from here
        (lately)."""
        if key not in self._popped:
            return False
        del self._popped[key]
        self.push_front(key)
        return True

    def forget(self, key: K) -> None:
        """`key` returns to the policy as new: no longer remembered as popped from here."""
        self._popped.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self._popped.clear()
        self._most_held = 0

    def check_integrity(self, held: Container[K], policy: str) -> None:
        """Raise `RuntimeError` (a bug) if a key the policy holds (`held`) is remembered as
        popped, or more keys are remembered than the bound."""
        if any(key in held for key in self._popped):
            raise RuntimeError(f"{policy}: a held key is also remembered as popped from the cold queue (a bug)")
        if len(self._popped) > self.limit:
            raise RuntimeError(f"{policy}: more keys remembered as popped from the cold queue than its bound (a bug)")


MAX_RATIO = 1e6  # a policy's multiple of its tier's capacity: far past any use


def check_ratio(what: str, value: object, *, upper: float = MAX_RATIO) -> float:
    """`value` as a float > 0 and below `upper`: a policy's share or multiple of its tier's
    capacity; `ConfigError` naming `what` otherwise (a bool, a string, NaN, too large)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < upper
    if not ok:
        raise ConfigError(f"{what} must be a number in (0, {upper:g}), got {value!r:.80}")
    return float(value)  # type: ignore[arg-type]  # a number once ok


def ratio_field(default: float, *, upper: float = MAX_RATIO) -> float:
    """A config field holding a share or multiple of the tier's capacity, below `upper`:
    `EvictionConfig` checks it (`check_ratio`) and keeps it as a float."""
    return field(default=default, metadata={"ratio_upper": upper})


def _check_ratios(config: object) -> None:
    """Check `config`'s `ratio_field`s (`ConfigError` naming the first bad one) and keep them as floats."""
    for f in fields(config):  # type: ignore[arg-type]  # an EvictionConfig: a dataclass
        if "ratio_upper" in f.metadata:
            value = check_ratio(f"{type(config).__name__}.{f.name}", getattr(config, f.name),
                                upper=f.metadata["ratio_upper"])
            object.__setattr__(config, f.name, value)


@dataclass(frozen=True)
class EvictionConfig(abc.ABC):
    """An eviction policy's config: a frozen dataclass registered by name with
    `register_eviction` beside the policy, whose `make` builds a new, empty policy. Its
    `ratio_field`s are checked after a subclass's own `__post_init__`, whether or not that
    calls this one's."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "checks_ratios", False):

            @functools.wraps(own)
            def post_init(self: EvictionConfig, *init_vars: Any) -> None:
                own(self, *init_vars)
                _check_ratios(self)  # the values it keeps, whatever its own set

            post_init.checks_ratios = True  # type: ignore[attr-defined]  # not wrapped twice (slots=True remakes the class)
            cls.__post_init__ = post_init  # type: ignore[method-assign]  # the wrapper, in its place

    def __post_init__(self) -> None:
        _check_ratios(self)

    @property
    def name(self) -> str:
        """The name it is registered as."""
        return EVICTION_POLICIES.name_of(self)

    @abc.abstractmethod
    def make(self, capacity_blocks: int) -> EvictionPolicy[Any]:
        """A new, empty policy for a tier of `capacity_blocks` blocks."""


EVICTION_POLICIES: Registry[EvictionConfig] = Registry(
    "eviction policy",
    EvictionConfig,
    ("tiers.policies.eviction", "tiers.policies.s3fifo", "tiers.policies.arc", "tiers.policies.lfu"),
)
register_eviction = EVICTION_POLICIES.register


@register_eviction("lru")
@dataclass(frozen=True)
class LRUConfig(EvictionConfig):
    def make(self, capacity_blocks: int) -> EvictionPolicy[Any]:
        return LRUPolicy(capacity_blocks)


def eviction_config(value: object, what: str = "eviction") -> EvictionConfig:
    """`value` as an eviction policy's config: an `EvictionConfig`, an `EvictionKind` or a
    registered name (its defaults), or a dict with its `type` (`tiers/plugins.py`);
    `ConfigError` naming `what` otherwise."""
    if isinstance(value, EvictionKind):
        value = value.value
    return EVICTION_POLICIES.config_from(value, what=what)


def make_policy(kind: EvictionConfig | EvictionKind | str, capacity_blocks: int) -> EvictionPolicy[K]:
    """A new, empty policy of `kind` for a tier of `capacity_blocks` blocks."""
    policy: EvictionPolicy[K] = eviction_config(kind).make(capacity_blocks)
    return policy
