"""The disk tier's in-memory index (`tiers/disk/mirror.py` over the compact hash set) while
another process writes the same directory: adversarial hashes (all 0x00, all 0xFF, sharing
their first 8 bytes, differing only in the last byte), duplicates in a batch, removals of
hashes never stored, more changes than a merge threshold, replayed through the change log
while this process probes and writes too. A hash never stored is never reported held; at
the end the copy equals a fresh build from the index and the integrity check holds."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch

from tests import ROOT
from tiers.disk.mirror import untagged
from tiers.disk.tier import LMDBTier
from tiers.keys import BlockHash, BlockKey

SHAPE = (2, 4)
ROUNDS = 120


def _pool(seed: int) -> tuple[list[bytes], list[bytes]]:
    """(hashes the processes store and remove, hashes nobody stores: each a byte away from
    or sharing 8 bytes with a stored one)."""
    rng = random.Random(seed)
    stored = {b"\x00" * 16, b"\xff" * 16, b"\x00" * 15 + b"\x01", b"\xff" * 15 + b"\xfe"}
    stored |= {b"\xab" * 8 + bytes([i]) * 8 for i in range(0, 256, 2)}
    stored |= {b"\x00" * 8 + bytes(7) + bytes([i]) for i in range(2, 200, 2)}
    stored |= {rng.randbytes(16) for _ in range(6000)}
    never = {b"\x00" * 15 + b"\x02", b"\xff" * 15 + b"\xfd", b"\x01" * 16}
    never |= {b"\xab" * 8 + bytes([i]) * 8 for i in range(1, 256, 2)}
    never |= {b"\x00" * 8 + bytes(7) + bytes([i]) for i in range(3, 200, 2)}
    never |= {h[:15] + bytes([h[15] ^ 1]) for h in rng.sample(sorted(stored), 200)}
    never -= stored
    return sorted(stored), sorted(never)


def _open(path: Path) -> LMDBTier:
    return LMDBTier(str(path), 64 << 20, SHAPE, torch.float16, sync=False, verify_tokens=False)


_WRITER = textwrap.dedent(
    """
    import random, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from tests.tiers.test_disk_mirror_processes import ROUNDS, _open, _pool, _rounds
    tier = _open(sys.argv[1])
    stored, _ = _pool(0)
    _rounds(tier, random.Random(int(sys.argv[3])), stored, ROUNDS)
    tier.close()
    """
)


def _rounds(tier: LMDBTier, rng: random.Random, stored: list[bytes], rounds: int) -> None:
    """Put batches (with duplicates) and remove batches (with hashes never stored)."""
    src = torch.zeros(SHAPE, dtype=torch.float16)
    for _ in range(rounds):
        batch = rng.sample(stored, rng.randrange(1, 300))
        batch += batch[: rng.randrange(3)]  # duplicates
        tier.put([BlockKey(BlockHash(h)) for h in batch], [src] * len(batch))
        gone = [*rng.sample(stored, rng.randrange(1, 200)), rng.randbytes(16)]
        tier.discard([BlockHash(h) for h in gone])


def test_the_in_memory_index_follows_another_process_through_merges_and_never_invents_a_hash(
        tmp_path: Path) -> None:
    stored, never = _pool(0)
    tier = _open(tmp_path)
    errors: list[BaseException] = []
    done = threading.Event()

    def probe() -> None:
        rng = random.Random(1)
        try:
            while not done.is_set():
                sample = [BlockHash(h) for h in rng.sample(never, 40)]  # (the first 16, then the rest)
                assert tier.match_prefix(sample) == 0
                mixed = [BlockHash(h) for h in rng.sample(stored, 20)] + sample[:1]
                assert tier.match_prefix(mixed, 20) == 0 and tier.match_prefix(mixed, 21) == 0
        except BaseException as exc:  # (reported by the test's thread)
            errors.append(exc)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(ROOT), "7"])
        _rounds(tier, random.Random(3), stored, ROUNDS // 2)
        assert writer.wait(timeout=600) == 0
    finally:
        done.set()
        prober.join(timeout=120)
    assert not errors, errors
    fresh = _open(tmp_path)  # (a second tier on the directory: its copy built from the index)
    try:
        truth = set(fresh.held_hashes())
        assert set(tier.held_hashes()) == truth and len(tier) == len(truth)
        assert 1000 < len(truth) < len(stored)
        for h in stored + never:
            assert tier.match_prefix([BlockHash(h)]) == (h in truth), h.hex()
        ordered = sorted(truth)
        assert tier.match_prefix([BlockHash(h) for h in ordered]) == len(ordered)
        assert tier.match_prefix([BlockHash(h) for h in ordered], 5) == len(ordered) - 5
        tier.check_integrity()
        fresh.check_integrity()
    finally:
        fresh.close()
        tier.close()



def test_a_log_records_keys_are_cut_to_this_namespaces_hashes() -> None:
    """`untagged` (the replay of a change-log record) keeps the hashes under this process's
    namespace tag and only those, in order, on the array path (keys of one length) and the
    per-key one (any other) alike."""
    rng = random.Random(7)
    mine, theirs = b"\x01" * 8, b"\x02" * 8
    keys = [rng.choice((mine, theirs)) + rng.randbytes(16) for _ in range(300)]
    expect = [k[8:] for k in keys if k[:8] == mine]
    assert untagged(keys, mine) == expect and all(type(h) is bytes for h in untagged(keys, mine))
    assert untagged(keys, b"\x03" * 8) == [] and untagged([], mine) == []
    odd = [*keys, mine + rng.randbytes(32), theirs[:4]]  # (lengths differ: per key)
    assert untagged(odd, mine) == [*expect, odd[-2][8:]]
