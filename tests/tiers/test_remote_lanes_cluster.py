"""A large remote read split into lanes (`Server.stream`) in a real Valkey/Redis cluster whose
slots moved: every lane that meets a redirect finds the slot's new master, whichever lane
rereads the slot map, and the read hits whole with no fault; a lane waiting for another's
reread waits no longer than its call's deadline.
"""

from __future__ import annotations

import time

import torch

from cli.redis_servers import redis_cluster
from tests.tiers.test_remote_lanes import LANES, NUM_BLOCKS, _blocks, _keys, _same, _tier
from tests.tiers.test_remote_stream import _move_slot_of
from tiers.remote.client import Server, lane_of
from tiers.remote.stream import _REFRESH_EVERY_S, Op, command


def test_a_split_read_finds_slots_moved_in_several_lanes_again() -> None:
    """Before, one lane's reread of the slot map made the others skip theirs (the reread
    under way, or 'done less than a second ago' marked at its start) and send the rest to
    the old master again, or pass the redirect on at once: the read stopped at that lane's
    first block, a counted fault (2 rounds of 3 in a run)."""
    with redis_cluster(3) as cluster:
        tier = _tier(cluster.url)
        try:
            blocks = _blocks(NUM_BLOCKS, 6)
            for round_ in range(3):
                keys = _keys(NUM_BLOCKS, 10 + round_)
                assert tier.put(keys, blocks) == NUM_BLOCKS and tier.flush() and tier.num_errors == 0
                time.sleep(_REFRESH_EVERY_S * 1.2)  # the slot map is reread at most this often
                moved: set[int] = set()
                for key in keys:  # one slot moved in each lane
                    server_key = tier.server_key(key.block_hash)
                    if lane_of(server_key, LANES) not in moved:
                        _move_slot_of(cluster.servers, server_key)
                        moved.add(lane_of(server_key, LANES))
                outs = [torch.zeros_like(b) for b in blocks]
                got = tier.get_into(keys, outs)
                assert (got, tier.num_errors) == (NUM_BLOCKS, 0), f"round {round_}: {got} blocks, " \
                    f"{tier.num_errors} faults"
                assert all(_same(a, b) for a, b in zip(outs, blocks))
        finally:
            tier.close()


def test_a_wait_for_another_lanes_slot_map_reread_ends_by_the_calls_deadline() -> None:
    """Before, a call that met a redirect while another lane of its call reread the slot map
    waited a flat second for that reread, past a shorter deadline of its own (about 1 s here
    for a 0.2 s call)."""
    with redis_cluster(3) as cluster:
        srv = Server(cluster.url, timeout_s=0.2, min_rate_bps=64 << 20, cooldown_s=0.0, window_bytes=1 << 20,
                     password=None)
        try:
            key = b"reread-wait"
            for _ in range(20):  # connects (a busy machine may need more than one try)
                if srv.call(srv.writes, "set", 64, lambda c: c.set(key, b"v"), 64):
                    break
            time.sleep(_REFRESH_EVERY_S * 1.2)  # the slot map is reread at most this often
            _move_slot_of(cluster.servers, key)
            streams = srv._streams
            assert streams is not None
            assert streams._refreshing.acquire(timeout=5)  # another lane's reread under way
            try:
                started = time.monotonic()
                srv.stream(srv.reads, "read", 64, [Op(key, command(b"GET", key), 64)], lambda i, reply: True)
                took = time.monotonic() - started
            finally:
                streams._refreshing.release()
            assert took < srv.limit(64) + 0.5, f"a call with a {srv.limit(64):.2f} s deadline took {took:.2f} s"
        finally:
            srv.close()
