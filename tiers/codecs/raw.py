"""The identity codec: the payload is the block's bytes in row-major order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tiers.codecs.base import Codec, CodecConfig, CodecKind, register_codec
from tiers.shared.blockcopy import copy_block, host_bytes


class RawCodec(Codec):
    """Payload = the block's bytes; decoding copies them into the destination."""

    kind = CodecKind.NONE

    def encode(self, src: torch.Tensor) -> bytearray:
        buf = bytearray(self.block_bytes)
        view = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        copy_block(view, src)
        return buf

    def decode(self, payload: memoryview | bytes | bytearray, dst: torch.Tensor) -> None:
        self.check_length(payload, self.block_bytes)
        src = np.frombuffer(payload, dtype=np.uint8)
        view = host_bytes(dst) if dst.is_contiguous() else None
        if view is not None:
            np.copyto(view.reshape(-1), src)
            return
        staged = torch.empty(self.block_shape, dtype=self.dtype)
        np.copyto(staged.view(torch.uint8).numpy().reshape(-1), src)
        dst.copy_(staged)


@register_codec("none")
@dataclass(frozen=True)
class RawConfig(CodecConfig):
    """The block's bytes as they are."""

    kind = CodecKind.NONE

    def build(self, block_shape: tuple[int, ...], dtype: torch.dtype, *,
              element_dtype: torch.dtype | None = None, group: int | None = None) -> Codec:
        return RawCodec(block_shape, dtype, element_dtype=element_dtype, group=group)
