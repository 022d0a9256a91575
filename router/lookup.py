"""`POST /lookup`: the request's validation, the scoring of instances, and the answer.

Scoring (docs/routing.md): an instance's score is the fraction of this request's prefill it
would save, each matched block weighted by what loading it from its tier saves over
recomputing it (`Scoring.weights`, pool > cpu > disk > remote), minus `load_weight` times the
load the caller reports for it (e.g. requests waiting in its queue). The best score wins;
ties go to the least loaded, then round-robin, so requests with no cached prefix spread out.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import ConfigError
from router.fleet import FleetView
from router.index import TIERS

MAX_TOKENS = 1 << 20
MAX_LOAD = 1e9
_FIELDS = ("token_ids", "cache_salt", "lora_id", "model", "load")


class BadRequest(Exception):
    """A malformed `/lookup` body; the message names the bad value (HTTP 400)."""


@dataclass(frozen=True)
class Scoring:
    """How `best` is chosen. `weights`: fraction of a block's prefill a hit saves, per tier
    (pool, cpu, disk, remote); `load_weight`: score lost per unit of reported load."""

    weights: tuple[float, float, float, float] = (1.0, 0.8, 0.5, 0.3)
    load_weight: float = 0.1

    def __post_init__(self) -> None:
        if len(self.weights) != 4 or not all(isinstance(w, (int, float)) and 0 <= w <= 1 for w in self.weights):
            raise ConfigError(f"tier weights must be 4 numbers in [0, 1] (pool, cpu, disk, remote), got {self.weights}")
        if not isinstance(self.load_weight, (int, float)) or not 0 <= self.load_weight < math.inf:
            raise ConfigError(f"load weight must be a number >= 0, got {self.load_weight!r}")

    @classmethod
    def parse_weights(cls, text: str) -> tuple[float, float, float, float]:
        """'pool=1,cpu=0.8,disk=0.5,remote=0.3' (any subset) over the defaults."""
        weights = dict(zip(TIERS, cls().weights))
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name.strip() not in weights:
                raise ConfigError(f"unknown tier {name.strip()!r} in tier weights; known: {list(TIERS)}")
            try:
                weights[name.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"tier weight {part!r} is not NAME=NUMBER") from None
        return (weights["pool"], weights["cpu"], weights["disk"], weights["remote"])

    def score(self, counts: list[int], block_size: int, num_tokens: int, load: float) -> float:
        saved = sum(w * c for w, c in zip(self.weights, counts)) * block_size
        return saved / max(num_tokens, 1) - self.load_weight * load


@dataclass(frozen=True)
class LookupQuery:
    tokens: np.ndarray
    salt: str | None
    lora: str | None
    model: str | None
    load: dict[str, float]


def parse_body(raw: bytes) -> object:
    """A request body as JSON; `BadRequest` if it is not (nesting too deep included)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise BadRequest("body is not JSON the router reads: nested too deeply") from None


def text_field(body: dict[str, Any], name: str) -> str | None:
    """`body[name]` if it is absent or valid UTF-8 text of at most 4096 characters; `BadRequest` if not."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 4096:
        raise BadRequest(f"{name} must be a string of at most 4096 characters, got {str(value)[:80]!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name} is not valid UTF-8 text") from None
    return value


def _load(value: object) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 4096:
        raise BadRequest(f"load must map instance ids to numbers in [0, {MAX_LOAD:g}], got {str(value)[:80]}")
    out = {}
    for key, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= MAX_LOAD:
            raise BadRequest(f"load must map instance ids to numbers in [0, {MAX_LOAD:g}], "
                             f"got {str(number)[:80]} for {str(key)[:80]!r}")
        out[str(key)] = float(number)
    return out


def parse_query(body: object) -> LookupQuery:
    """Validate a decoded JSON body; `BadRequest` naming the first bad value."""
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown[:10]}; known: {list(_FIELDS)}")
    tokens = body.get("token_ids")
    if not isinstance(tokens, list):
        raise BadRequest(f"token_ids must be a list of integers, got {type(tokens).__name__}")
    if len(tokens) > MAX_TOKENS:
        raise BadRequest(f"token_ids has {len(tokens)} tokens, more than {MAX_TOKENS}")
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32][:1]
    if bad:
        raise BadRequest(f"token_ids must be integers in [0, 2**32), got {str(bad[0])[:80]}")
    lora = body.get("lora_id")
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, (int, str))
                             or (isinstance(lora, int) and not -(2**63) <= lora < 2**64)):
        raise BadRequest(f"lora_id must be a 64-bit integer or a string, got {str(lora)[:80]}")
    if isinstance(lora, str):
        lora = text_field(body, "lora_id")
    return LookupQuery(np.asarray(tokens, dtype="<u4"), text_field(body, "cache_salt"),
                       None if lora is None else str(lora), text_field(body, "model"), _load(body.get("load")))


class Chooser:
    """Answers lookups over a `FleetView` with a `Scoring`."""

    def __init__(self, fleet: FleetView, scoring: Scoring) -> None:
        self.fleet, self.scoring = fleet, scoring
        self._turn = itertools.count()

    def answer(self, query: LookupQuery, now: float | None = None) -> dict[str, Any]:
        """The `/lookup` response for a validated query."""
        candidates = self.fleet.candidates(query.model, time.monotonic() if now is None else now)
        matched = self.fleet.match(query.tokens, query.salt, query.lora, candidates)
        instances: dict[str, Any] = {}
        for name in sorted(candidates):
            c, bs = matched[name]
            load = query.load.get(name, 0.0)
            instances[name] = {
                "matched_tokens": sum(c) * bs,
                "by_tier": {tier: n * bs for tier, n in zip(TIERS, c)},
                "score": round(self.scoring.score(c, bs, len(query.tokens), load), 6),
                "load": load,
            }
        best = None
        if instances:
            top = max(v["score"] for v in instances.values())
            tied = sorted(k for k, v in instances.items() if v["score"] >= top - 1e-9)
            least = min(instances[k]["load"] for k in tied)
            tied = [k for k in tied if instances[k]["load"] == least]
            best = tied[next(self._turn) % len(tied)]
        return {"best": best, "instances": instances}
