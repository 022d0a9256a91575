"""Writes into the remote tier, against real `redis-server` processes: a store larger than
the write queue is shared whole (the caller waits for room), blocks go parents first so a
server that fills up keeps a prefix, a drop is a counted tail and never a hole before kept
blocks, each block of a store reaches the server once, and a delete is never undone by a
write still queued.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
import xxhash

from cli.redis_servers import redis_server
from kvstore import KVLayout
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.test_remote import _remote, _store, _tokens
from tiers.keys import BlockHash, BlockKey, TierKind
from tiers.remote.tier import RemoteTier
from tiers.remote.writer import Record

LLAMA_3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 128 KiB a token


def _present(raw: redis.Redis, tier: RemoteTier, hashes: list[BlockHash]) -> list[bool]:
    return [bool(raw.exists(tier.server_key(h))) for h in hashes]


@pytest.mark.slow
def test_a_store_larger_than_the_write_queue_is_shared_whole() -> None:
    """2,304 tokens of a Llama-3-8B layout are 288 MiB of records, more than the 256 MiB the
    remote tier queues by default: the store waits for room rather than dropping, so another
    host gets the whole prompt, bit-exact."""
    tokens = 2304
    t = _tokens(tokens // 16, 1)
    with redis_server() as server:
        with _store(server.url, layout=LLAMA_3_8B, block_size=16, cpu_bytes=0, disk_path=None) as host_a:
            host_a.store(t, make_kv(t, LLAMA_3_8B, 16))
            assert host_a.flush()
            assert _remote(host_a).num_write_drops == 0 and _remote(host_a).num_errors == 0
        with _store(server.url, layout=LLAMA_3_8B, block_size=16, cpu_bytes=0, disk_path=None) as host_b:
            res = host_b.retrieve(t)
            assert res.num_tokens == tokens and res.blocks_per_tier == {TierKind.REMOTE: tokens // 16}
            check_kv(t, res.kv, res.num_tokens, LLAMA_3_8B, 16)


def test_a_server_that_fills_up_keeps_a_prefix() -> None:
    """One store of ~4 MiB into a `noeviction` server with room for about half: the blocks it
    keeps are the prompt's first ones, so another host hits them; the refused tail is counted."""
    t = _tokens(1000, 2)
    with redis_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as server:
        with _store(server.url, cpu_bytes=0, disk_path=None) as host_a:
            host_a.store(t, make_kv(t, LAYOUT, BLOCK))
            assert host_a.flush()
            tier = _remote(host_a)
            present = _present(redis.Redis(port=server.port), tier, host_a.block_hashes(t))
            kept = sum(present)
            assert 0 < kept < len(present)
            assert present == [True] * kept + [False] * (len(present) - kept), "a hole before kept blocks"
            assert tier.num_write_drops == len(present) - kept and tier.writes.num_errors >= 1
        with _store(server.url, cpu_bytes=0, disk_path=None) as host_b:
            res = host_b.retrieve(t)
            assert res.num_tokens == kept * BLOCK
            check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)


def _keys(n: int, seed: int) -> tuple[list[BlockKey], list[torch.Tensor]]:
    """`n` blocks of one made-up sequence, prefix order, for a tier used on its own."""
    keys = [BlockKey(BlockHash(xxhash.xxh3_128_digest(f"{seed}:{i}".encode()))) for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(LAYOUT.block_shape(BLOCK), generator=gen).to(LAYOUT.dtype) for _ in range(n)]
    return keys, srcs


def _tier(url: str, **kwargs: object) -> RemoteTier:
    return RemoteTier(url, LAYOUT.block_shape(BLOCK), LAYOUT.dtype, namespace=b"writes-test", **kwargs)  # type: ignore[arg-type]


def test_a_put_larger_than_the_queue_waits_for_room() -> None:
    """A queue of 64 KiB and a put of 1 MiB (eviction order, as the stack gives it): every
    block reaches the server, none is dropped."""
    keys, srcs = _keys(256, 3)
    with redis_server() as server:
        tier = _tier(server.url, max_pending_bytes=64 << 10)
        try:
            assert tier.put(keys[::-1], srcs[::-1]) == 256
            assert tier.flush()
            assert tier.num_write_drops == 0 and tier.match_prefix([k.block_hash for k in keys]) == 256
            out = [torch.empty_like(s) for s in srcs]
            assert tier.get_into(keys, out) == 256
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(out, srcs))
            tier.check_integrity()
        finally:
            tier.close()


def test_a_drop_is_a_counted_tail_never_a_hole(caplog: pytest.LogCaptureFixture) -> None:
    """The server stops (SIGSTOP) during a put larger than the queue: the writer's batches time
    out, its breaker opens, and the put gives up, dropping the rest of the sequence. Whatever
    the server stored once it runs again is a prefix; every drop is counted and warned."""
    keys, srcs = _keys(256, 4)
    hashes = [k.block_hash for k in keys]
    with redis_server() as server:
        assert server.proc is not None
        tier = _tier(server.url, max_pending_bytes=64 << 10, timeout_s=0.3)
        try:
            os.kill(server.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            with caplog.at_level("WARNING"):
                queued = tier.put(keys[::-1], srcs[::-1])
                assert tier.flush()
            assert time.monotonic() - started < 30
            assert queued < 256 and tier.num_write_drops >= 256 - queued
            assert "block writes dropped" in caplog.text
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # the server runs what reached its socket before the client gave up
        present = _present(redis.Redis(port=server.port), tier, hashes)
        kept = sum(present)
        assert present == [True] * kept + [False] * (len(present) - kept), "a hole before kept blocks"
        tier.close()


def test_each_block_of_a_store_reaches_the_server_once() -> None:
    """A store larger than the CPU tier (no disk): the blocks that overflow the CPU tier are
    not demoted into the remote tier as well as written through to it."""
    t = _tokens(40, 5)
    cpu_bytes = 16 * LAYOUT.block_bytes(BLOCK)
    with redis_server() as server, _store(server.url, disk_path=None, cpu_bytes=cpu_bytes) as store:
        raw = redis.Redis(port=server.port)
        raw.config_resetstat()
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        assert store.flush()
        assert raw.info("commandstats")["cmdstat_set"]["calls"] == 40
        assert _remote(store).num_write_drops == 0
        res = store.retrieve(t)
        assert res.num_tokens == len(t)
        check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)


@pytest.mark.slow
def test_demo_remote_at_its_default_size_shares_the_whole_document(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`kvstrata demo-remote` with its defaults (8,192 tokens, 256 MiB of KV), against a server
    with a password given in the URL: host B gets every token from the remote tier, and the
    printed URL shows no password."""
    from cli import main as kvstrata

    with redis_server("--requirepass", "demoS3cret") as server:
        url = f"redis://127.0.0.1:{server.port}/0?password=demoS3cret"
        rc = kvstrata.main(["demo-remote", "--url", url, "--disk-path", str(tmp_path / "d")])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("host ")]
    assert "remote 8192" in rows[1] and [r.split()[-1] for r in rows] == ["yes"] * 3, out
    assert "demoS3cret" not in out


def test_a_discard_is_not_undone_by_a_write_still_queued() -> None:
    """Verify's quarantine deletes a key while a write of it may still wait in the writer: the
    writer is held in its send (a real one, to a real server, once let go) with block A's
    batch in flight and block B's record queued behind it; `discard([A, B])` takes B off the
    queue and waits for A's send before it deletes. Once the writer has run, neither key is on
    the server (before: the delete came first and both writes then put the blocks back)."""
    keys, srcs = _keys(2, 6)
    hashes = [k.block_hash for k in keys]
    with redis_server() as server:
        tier = _tier(server.url)
        raw = redis.Redis(port=server.port)
        held, let_go = threading.Event(), threading.Event()
        send = tier._writes._send

        def held_send(batch: list[Record]) -> list[bool]:
            held.set()
            assert let_go.wait(30)
            return send(batch)

        tier._writes._send = held_send
        try:
            assert tier.put([keys[0]], [srcs[0]]) == 1
            assert held.wait(30)  # A's batch is in flight, held
            assert tier.put([keys[1]], [srcs[1]]) == 1  # B's record waits in the queue
            threading.Timer(0.5, let_go.set).start()
            tier.discard(hashes)
            let_go.set()
            assert tier.flush()
            assert _present(raw, tier, hashes) == [False, False]
            assert tier.match_prefix(hashes) == 0 and tier.num_write_drops == 0
            tier.check_integrity()
            assert tier.put(keys, srcs) == 2 and tier.flush()  # the keys are writable again
            assert _present(raw, tier, hashes) == [True, True]
        finally:
            let_go.set()
            tier.close()
