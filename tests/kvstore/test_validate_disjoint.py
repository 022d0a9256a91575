"""`check_disjoint` against a brute-force oracle: destinations are refused exactly when two
of their elements (within one tensor or across them) share a byte. Views of one storage of
mixed dtypes: contiguous ones (with size-1 dimensions of any stride), sliced, permuted,
interleaved and expanded ones, zero-element ones.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from kvstore import InvalidInputError
from kvstore.validate import check_disjoint

_DTYPES = (torch.uint8, torch.int16, torch.float32)


def _bytes_of(t: torch.Tensor) -> list[int]:
    """Every byte address of `t`'s elements, once per element that covers it."""
    es = t.element_size()
    starts = [t.data_ptr() + es * sum(i * s for i, s in zip(index, t.stride()))
              for index in itertools.product(*(range(n) for n in t.shape))]
    return [a + k for a in starts for k in range(es)]


def _view(rng: random.Random, base: torch.Tensor) -> torch.Tensor:
    """A random view of `base` (bytes): contiguous, contiguous with odd size-1 strides,
    strided (sliced, permuted, stepped), expanded, or empty."""
    dtype = rng.choice(_DTYPES)
    es = torch.empty(0, dtype=dtype).element_size()
    at = rng.randrange(0, 64) * es
    flat = base[at : at + (base.numel() - at) // es * es].view(dtype)
    shape = [rng.choice([0, 1, 1, 2, 3, 4]) if rng.random() < 0.05 else rng.choice([1, 1, 2, 3, 4])
             for _ in range(rng.randint(1, 4))]
    kind = rng.choice(["contiguous", "size-1 strides", "strided", "strided", "expanded"])
    if kind == "strided":
        strides = [rng.choice([1, 2, 3, 5, 8, 13]) for _ in shape]
    else:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        if kind == "size-1 strides":
            strides = [rng.choice([0, 7, 300]) if n == 1 else s for n, s in zip(shape, strides)]
        elif kind == "expanded" and max(shape) > 1:
            strides[shape.index(max(shape))] = 0
    reach = sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if all(shape) else 0
    offset = rng.randrange(0, max(1, flat.numel() - reach - 300))
    return torch.as_strided(flat, shape, strides, flat.storage_offset() + offset)


def test_destinations_are_refused_exactly_when_two_elements_share_a_byte() -> None:
    rng = random.Random(5)
    base = torch.zeros(4096, dtype=torch.uint8)
    seen = {True: 0, False: 0}
    contiguous_with_strided = 0
    for _ in range(3000):
        tensors = [_view(rng, base) for _ in range(rng.randint(1, 4))]
        addresses = [a for t in tensors for a in _bytes_of(t)]
        overlap = len(set(addresses)) != len(addresses)
        try:
            check_disjoint(tensors, "destination blocks")
            refused = False
        except InvalidInputError as exc:
            refused = True
            assert "cannot prove" not in str(exc)  # small tensors: always listed, never guessed
        assert refused == overlap, [(t.shape, t.stride(), t.data_ptr() - base.data_ptr(), t.dtype) for t in tensors]
        seen[overlap] += 1
        kinds = {t.is_contiguous() for t in tensors if t.numel()}
        contiguous_with_strided += overlap and kinds == {True, False}
    assert min(seen.values()) > 500 and contiguous_with_strided > 50  # both verdicts, and mixed kinds, exercised


@pytest.mark.parametrize("step", [1, 2])
def test_a_contiguous_block_inside_a_strided_ones_gap_is_accepted_and_one_over_its_run_is_not(step: int) -> None:
    """A strided tensor's runs leave gaps: a contiguous destination that fits in one is
    disjoint from it, one that reaches into a run (by one element) is not."""
    base = torch.zeros(64, dtype=torch.int16)
    strided = base.view(8, 8)[:, :4]  # runs of 4 elements, gaps of 4
    inside = base[4 + 8 * step : 8 + 8 * step]  # a whole gap
    check_disjoint([strided, inside], "destination blocks")
    check_disjoint([inside, strided], "destination blocks")
    for over in (base[3 + 8 * step : 7 + 8 * step], base[5 + 8 * step : 9 + 8 * step]):
        with pytest.raises(InvalidInputError, match="overlap"):
            check_disjoint([strided, over], "destination blocks")
