"""`copy_block` equals `Tensor.copy_` for every KV dtype and stride pattern it meets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvstore  # noqa: F401  (before tiers: `import tiers` alone is circular today)
from tests import ROOT
from tiers.shared.blockcopy import copy_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_copy_block_matches_copy_(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 255, (2, 2, 4, 3, 8), generator=g, dtype=torch.uint8)
    if dtype.itemsize != 1:
        shape = (2, 2, 4, 3, 8 * dtype.itemsize)
        src = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    src = src.view(dtype)
    dst = torch.zeros_like(src)
    copy_block(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_copy_block_strided_views() -> None:
    big = torch.arange(4 * 2 * 4 * 3 * 8, dtype=torch.float32).view(4, 2, 4, 3, 8)
    src = big[:, :, 1:3]  # strided
    dst_big = torch.zeros(4, 2, 5, 3, 8)
    dst = dst_big[:, :, 2:4]
    copy_block(dst, src)
    assert torch.equal(dst, src) and not dst_big[:, :, :2].any()
    t = torch.zeros(3, 8).t()  # last dim strided: falls back to torch
    copy_block(t, torch.ones(8, 3))
    assert torch.equal(t, torch.ones(8, 3))



_SLAB_IN_A_HEAP = """
import ctypes, gc, json
assert ctypes.CDLL(None).mallopt(-4, 0) == 1  # M_MMAP_MAX = 0: malloc serves large blocks from its heap
import torch
import kvstore
from tiers.cpu.tier import CPUTier

def mapping(addr):
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= addr < end:
            return [start, end, line.split()[-1] if len(line.split()) > 5 else ""]

from tiers.pool.gpu_pool import BlockPool
out = []
for tier, data in ((CPUTier(64, (2, 2, 16, 4, 64), torch.bfloat16, pin_memory=False), "slab"),
                   (BlockPool(64, (2, 2, 16, 4, 64), torch.bfloat16, device="cpu"), "kv_cache")):
    before = mapping(getattr(tier, data).data_ptr())
    tier.close()
    gc.collect()
    out.append([before, mapping(before[0])])
print(json.dumps(out))
"""


def test_host_kv_has_a_mapping_of_its_own_that_close_returns() -> None:
    """Even where malloc would carve a large block out of its heap (here: mmap disabled for
    malloc), the CPU tier's slab and a CPU block pool's KV tensor are each a mapping of their
    own, and closing the tier unmaps it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _SLAB_IN_A_HEAP], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    for before, after in json.loads(done.stdout.strip().splitlines()[-1]):
        assert before[2] != "[heap]" and before[1] - before[0] >= 64 * 2 * 2 * 16 * 4 * 64 * 2, before
        assert after is None or after[:2] != before[:2], (before, after)
