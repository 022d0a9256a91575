"""The KV layout: the shape and dtype of one token's KV, and the dtypes a cache is held in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from tiers.plugins import is_int_at_least

# dtypes a KV cache is held in. uint8 covers engines whose blocks are opaque bytes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
MAX_DIM = 1 << 31  # bound on a layout's dimensions and a block's tokens: what no KV cache comes near


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical short name of a supported torch dtype ('bfloat16', ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}")
    return name


def parse_dtype(value: object, what: str) -> torch.dtype:
    """`value` (a supported torch dtype or its name) as a torch dtype; `ConfigError` naming
    `what` and the choices otherwise."""
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    if isinstance(value, torch.dtype) and str(value).removeprefix("torch.") in DTYPES:
        return value
    raise ConfigError(f"{what} must be one of {sorted(DTYPES)}, got {value!r}")


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one token's KV: `num_layers` x (K, V) x `num_kv_heads` x `head_dim`.

    A block of `block_size` tokens is the tensor `[num_layers, 2, block_size, num_kv_heads,
    head_dim]`; `dtype` may be given as a torch dtype or its name.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1) or value > MAX_DIM:
                raise ConfigError(f"KVLayout.{name} must be an int in [1, {MAX_DIM}], got {value!r}")
        dtype = self.dtype
        if isinstance(dtype, str):
            if dtype.removeprefix("torch.") not in DTYPES:
                raise ConfigError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}")
            object.__setattr__(self, "dtype", DTYPES[dtype.removeprefix("torch.")])
        elif isinstance(dtype, torch.dtype):
            dtype_name(dtype)
        else:
            raise ConfigError(f"KVLayout.dtype must be a torch.dtype or name, got {dtype!r}")

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token, K and V of every layer together."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        return self.token_bytes * block_size

    def identity(self) -> list[object]:
        """Canonical, hashable description that enters every block key."""
        return [self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_name]
