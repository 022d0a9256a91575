"""The remote tier's lanes (`tiers/remote/lanes.py`) across a process's life, against a real
`redis-server`: a forked child (vLLM forks its workers) runs split calls on workers of its own
and keeps no reference to a call's buffers after it returned; a store closed from an `atexit`
handler (the interpreter shutting down: no new thread may start) still stores its writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import redis

from cli.redis_servers import redis_server
from tiers.remote.client import SPLIT_FROM, Server
from tiers.remote.stream import Op, command

LANES = 4
VALUE_BYTES = 256 << 10
NUM_KEYS = 2 * SPLIT_FROM // VALUE_BYTES  # a call past `SPLIT_FROM`: split into lanes


def _split_write(srv: Server, value: bytearray, tag: bytes) -> tuple[bool, set[str]]:
    """One call SETting `NUM_KEYS` keys to `value` over the lanes; whether it succeeded and
    the threads its replies came on."""
    keys = [b"lanes-process:%s:%d" % (tag, i) for i in range(NUM_KEYS)]
    head = Op(b"lanes-process:head", command(b"GET", b"lanes-process:head"), 64)
    ops = [head, *(Op(k, command(b"SET", k, memoryview(value)), VALUE_BYTES) for k in keys)]
    threads: set[str] = set()
    ok = srv.stream(srv.writes, "split write", NUM_KEYS * VALUE_BYTES, ops,
                    lambda i, reply: threads.add(threading.current_thread().name) is None, head=1)
    return ok, threads


def test_a_forked_child_runs_lanes_on_its_own_workers_and_keeps_no_buffer_of_a_finished_call() -> None:
    """The parent's lane workers do not exist in a forked child: before, the child queued each
    split call's lanes for them for ever (the work items holding the call's ops and values, so
    memory grew with every call) and ran every lane on the caller's thread."""
    with redis_server() as server:
        srv = Server(server.url, timeout_s=5.0, min_rate_bps=64 << 20, cooldown_s=5.0, window_bytes=1 << 20,
                     password=None, connections_per_node=LANES)
        try:
            value = bytearray(os.urandom(VALUE_BYTES))
            ok, threads = _split_write(srv, value, b"parent")
            assert ok and len(threads) > 1  # the parent's workers exist and ran lanes
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report over the pipe, never return into pytest
                code = 1
                try:
                    mine = bytearray(os.urandom(VALUE_BYTES))
                    before = sys.getrefcount(mine)
                    results = [_split_write(srv, mine, b"child%d" % r) for r in range(3)]
                    held = sys.getrefcount(mine) - before
                    workers = set().union(*(t for _, t in results)) - {threading.current_thread().name}
                    report = f"{all(ok for ok, _ in results)} {held} {len(workers)}"
                    os.write(write_end, report.encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(write_end)
            _, status = os.waitpid(pid, 0)
            report = os.read(read_end, 256).decode().split()
            os.close(read_end)
            assert os.waitstatus_to_exitcode(status) == 0, "the child failed"
            ok_child, held, workers = report[0] == "True", int(report[1]), int(report[2])
            assert ok_child, "a split call failed in the forked child"
            assert held == 0, f"{held} references to a finished call's value are left in the child"
            assert workers >= 1, "the child ran every lane on the caller's thread"
            raw = redis.Redis(port=server.port)
            assert raw.get(b"lanes-process:child2:%d" % (NUM_KEYS - 1)) is not None
        finally:
            srv.close()


def _run(script: str, url: str) -> subprocess.CompletedProcess[str]:
    """Run `script` in a fresh interpreter (this checkout first on its path) with the server's
    URL as its argument; it must exit 0."""
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done


_AT_EXIT = textwrap.dedent("""
    import atexit, sys
    import torch
    from tiers.keys import BlockHash, BlockKey
    from tiers.remote.tier import RemoteTier

    shape, n = (2, 2, 32, 8, 128), 32  # 256 KiB bfloat16 blocks: 8 MiB a write, split into lanes
    tier = RemoteTier(sys.argv[1], shape, torch.bfloat16, namespace=b"at-exit", timeout_s=5.0,
                      connections_per_node=4)
    blocks = [torch.full(shape, float(i), dtype=torch.bfloat16) for i in range(n)]

    def keys(seed):
        return [BlockKey(BlockHash(bytes([seed, i]) * 8)) for i in range(n)]

    assert tier.put(keys(1), blocks) == n and tier.flush()  # the lanes' workers exist

    def at_exit():
        tier.put(keys(2), blocks)
        tier.close()
        print("drops", tier.num_write_drops, "errors", tier.writes.num_errors, flush=True)

    atexit.register(at_exit)
""")


def test_a_store_closed_at_exit_still_stores_its_split_writes() -> None:
    """Before, once the interpreter was shutting down the lanes' pool refused new work
    (RuntimeError): each large batch a close from `atexit` flushed was a counted server fault
    and every block of it a dropped write."""
    with redis_server() as server:
        done = _run(_AT_EXIT, server.url)
        assert "drops 0 errors 0" in done.stdout, done.stdout + done.stderr
        raw = redis.Redis(port=server.port)
        assert len(raw.keys(b"kvstrata:*")) >= 64  # both writes' blocks (and the generation)


_FORK_WRITES = textwrap.dedent("""
    import os, sys
    import torch
    from tiers.keys import BlockHash, BlockKey
    from tiers.remote.tier import RemoteTier

    torch.set_num_threads(1)  # torch's own thread pool does not cross a fork
    shape, n = (2, 2, 32, 8, 128), 32
    blocks = [torch.full(shape, float(i), dtype=torch.bfloat16) for i in range(n)]

    def keys(seed):
        return [BlockKey(BlockHash(bytes([seed, i]) * 8)) for i in range(n)]

    tier = RemoteTier(sys.argv[1], shape, torch.bfloat16, namespace=b"fork", timeout_s=5.0, connections_per_node=4)
    assert tier.put(keys(1), blocks) == n and tier.flush()
    outs = [torch.zeros_like(b) for b in blocks]
    pid = os.fork()
    if pid == 0:
        try:
            put = tier.put(keys(2), blocks)
            flushed = tier.flush(timeout_s=20.0)
            got = tier.get_into(keys(2), outs)
            same = all(bool((a == b).all()) for a, b in zip(outs, blocks))
            print("child", put, flushed, tier.num_write_drops, got, same, flush=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    tier.close()
""")


def test_a_forked_child_sends_its_writes() -> None:
    """The parent's writer thread does not exist in a forked child: before, the child's writes
    were queued and never sent (its flush timed out, nothing counted as dropped)."""
    with redis_server() as server:
        done = _run(_FORK_WRITES, server.url)
        assert "child 32 True 0 32 True" in done.stdout, done.stdout + done.stderr
