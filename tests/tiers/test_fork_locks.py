"""The shared tiers in a forked child (vLLM forks its workers) whose parent's threads held the
tiers' locks while it forked: the child renews every one of them (`tiers/shared/forks.py`),
so its stores and reads run instead of waiting for ever on a lock no thread of the child
will ever release. Against a real `redis-server`, a Mooncake tier whose master is down, and
a shared-filesystem tier on a local directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cli.redis_servers import redis_cluster, redis_server
from tests.mooncake_fixtures import MooncakeMaster, mooncake_master, need_mooncake

# A tier and `locks` (name: a function reading the lock, so the child reads the renewed one)
# come from SETUP; a parent's thread holds every lock while the process forks; the child
# prints which are still held, then runs CHILD, killed by its alarm if that hangs.
_HELD_AT_FORK = """
import os, signal, sys, threading
import torch
from tiers.keys import BlockHash, BlockKey

torch.set_num_threads(1)  # torch's own thread pool does not cross a fork
shape, n = (2, 2, 32, 8, 128), 8  # 256 KiB bfloat16 blocks: the remote tier's reused buffers
blocks = [torch.full(shape, float(i), dtype=torch.bfloat16) for i in range(n)]

def keys(seed):
    return [BlockKey(BlockHash(bytes([seed, i]) * 8)) for i in range(n)]

SETUP
common = {
    "record checks": lambda: tier._checks._lock, "data warnings": lambda: tier._warn_data._lock,
    "drop warnings": lambda: tier._warn_drop._lock, "change log": lambda: tier._changes._lock,
}
locks.update(common)
held, release = threading.Event(), threading.Event()

def hold():  # a parent's thread inside every critical section at once
    taken = [lock() for lock in locks.values()]
    for lock in taken:
        lock.acquire()
    held.set()
    release.wait()
    for lock in taken:
        lock.release()

threading.Thread(target=hold, daemon=True).start()
assert held.wait(10)
pid = os.fork()
if pid == 0:
    try:
        signal.alarm(60)
        print("locked", sorted(name for name, lock in locks.items() if lock().locked()), flush=True)
CHILD
    finally:
        os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
release.set()
tier.close()
"""


def _run(setup: str, child: str, *args: str) -> str:
    """The script with `setup` and `child` (indented into the child's block) run in a fresh
    interpreter with `args`; its output, once it exited 0 with a child that did."""
    script = _HELD_AT_FORK.replace("SETUP", textwrap.dedent(setup)).replace(
        "CHILD", textwrap.indent(textwrap.dedent(child), " " * 8))
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "child exit 0" in done.stdout, out
    assert "locked []" in done.stdout, out
    return out


def test_a_forked_remote_tier_renews_the_locks_a_parents_thread_held() -> None:
    """Before, only the lane workers', the writer's and the slot map's locks were renewed: a
    child forked while another parent thread held, e.g., the client's connect lock or a
    health lock hung in its first call (killed by its alarm: no result line)."""
    with redis_server() as server:
        out = _run("""
            from tiers.remote.tier import RemoteTier
            tier = RemoteTier(sys.argv[1], shape, torch.bfloat16, namespace=b"fork-locks", timeout_s=5.0)
            tier.take_changes()  # the stack takes them: changes are recorded
            assert tier.put(keys(1), blocks) == n and tier.flush()
            locks = {"reads' health": lambda: tier.reads._lock, "writes' health": lambda: tier.writes._lock,
                     "connect": lambda: tier._server._lock, "record buffers": lambda: tier._buffers._lock,
                     "slot map reread": lambda: (tier._server._connect(), tier._server._streams)[1]._refreshing,
                     "tier counts": lambda: tier._count_lock}
        """, """
            put = tier.put(keys(2), blocks)
            flushed = tier.flush(timeout_s=20.0)
            outs = [torch.zeros_like(b) for b in blocks]
            got = tier.get_into(keys(2), outs)
            same = all(bool((a == b).all()) for a, b in zip(outs, blocks))
            print("child", put, flushed, tier.num_write_drops, got, same, flush=True)
        """, server.url)
        assert "child 8 True 0 8 True" in out, out


def test_a_forked_remote_tier_on_a_cluster_gets_a_client_of_its_own() -> None:
    """A cluster client's slot-map locks (redis-py's, held while it rereads the map, e.g. after
    a redirect) held by a parent's thread as it forked: before, the child kept its parent's
    client, so its first read that met a moved slot waited for ever to reread the map (killed
    by its alarm). Now the child connects a client of its own (`Server._after_fork`)."""
    with redis_cluster(3) as cluster:
        out = _run("""
            from tiers.remote.tier import RemoteTier

            class AsLock:  # an RLock seen as a Lock (an RLock has no `locked` before Python 3.14)
                def __init__(self, lock):
                    self.lock = lock
                def acquire(self):
                    self.lock.acquire()
                def release(self):
                    self.lock.release()
                def locked(self):
                    if self.lock.acquire(blocking=False):
                        self.lock.release()
                        return False
                    return True

            tier = RemoteTier(sys.argv[1], shape, torch.bfloat16, namespace=b"fork-locks", timeout_s=5.0)
            tier.take_changes()  # the stack takes them: changes are recorded
            assert tier.put(keys(1), blocks) == n and tier.flush()
            nodes = lambda: tier._server._connect().nodes_manager  # the client the process uses
            locks = {"slot map": lambda: AsLock(nodes()._lock),
                     "slot map reread": lambda: AsLock(nodes()._initialization_lock)}
        """, """
            from types import SimpleNamespace
            from tests.tiers.test_remote_stream import _move_slot_of
            servers = [SimpleNamespace(port=int(p)) for p in sys.argv[2].split(",")]
            _move_slot_of(servers, tier.server_key(keys(1)[0].block_hash))  # a redirect: the map reread
            outs = [torch.zeros_like(b) for b in blocks]
            got = tier.get_into(keys(1), outs)
            same = all(bool((a == b).all()) for a, b in zip(outs, blocks))
            print("child", got, same, tier.num_errors, flush=True)
        """, cluster.url, ",".join(str(s.port) for s in cluster.servers))
        assert "child 8 True 0" in out, out


def test_a_forked_mooncake_tier_renews_the_locks_a_parents_thread_held() -> None:
    """Before, a child forked while another parent thread held the client's setup lock (a
    setup runs for up to `setup_timeout_s`) hung in its first call; one forked while the
    workers' or the transfer buffer's lock was held hung in its first call that got that far.
    The master is down: each call is a counted fault, at once."""
    master = MooncakeMaster(need_mooncake())  # never started
    out = _run("""
        from tiers.mooncake.client import ClientParams
        from tiers.mooncake.tier import MooncakeTier
        params = ClientParams("127.0.0.1", sys.argv[2], 16 << 20, 16 << 20, "tcp", "", sys.argv[1])
        tier = MooncakeTier(params, shape, torch.bfloat16, namespace=b"fork-locks", cooldown_s=0.1,
                            buffer_bytes=8 << 20)
        locks = {"reads' health": lambda: tier.reads._lock, "writes' health": lambda: tier.writes._lock,
                 "setup": lambda: tier._conn._setup_lock, "workers": lambda: tier._conn._workers._lock,
                 "transfer buffer": lambda: tier._conn.regions._lock}
    """, """
        put = tier.put(keys(2), blocks)
        got = tier.get_into(keys(2), [torch.zeros_like(b) for b in blocks])
        print("child", put, got, tier.num_write_drops > 0, tier.num_errors > 0, flush=True)
    """, master.master, master.metadata_server)
    assert "child 0 0 True True" in out, out


# The parent opens a Mooncake tier on a live master and stores: its client is set up.
_MOONCAKE_CLIENT_SET_UP = """
    from tiers.mooncake.client import ClientParams
    from tiers.mooncake.tier import MooncakeTier
    params = ClientParams("127.0.0.1", sys.argv[2], 64 << 20, 16 << 20, "tcp", "", sys.argv[1])

    def open_tier():
        return MooncakeTier(params, shape, torch.bfloat16, namespace=b"fork-client", timeout_s=2.0, cooldown_s=0.5,
                            buffer_bytes=8 << 20)

    tier = open_tier()
    assert tier.put(keys(1), blocks) == n
    locks = {}
"""


def test_a_forked_mooncake_tier_whose_parent_set_up_its_client_misses_at_once() -> None:
    """The parent's Mooncake client does not cross a fork (its calls are never answered in
    the child, and a setup of another hangs there). Before, each call of the child waited out
    its deadline and was abandoned, holding a region of the transfer buffer for ever (after
    two, every call failed for want of one); now each is a counted fault at once."""
    with mooncake_master() as master:
        out = _run(_MOONCAKE_CLIENT_SET_UP, """
            got = tier.get_into(keys(1), [torch.zeros_like(b) for b in blocks])
            put = tier.put(keys(2), blocks)
            print("child", got, put, tier.num_errors > 0, tier._conn.regions.num_free, flush=True)
        """, master.master, master.metadata_server)
        assert "child 0 0 True 2" in out, out


def test_a_new_mooncake_tier_in_a_child_of_a_process_that_set_up_a_client_misses_at_once() -> None:
    """Mooncake's `setup` of a client in a child forked after its parent set one up hangs,
    holding the interpreter's lock, so no deadline bounds it. Before, a NEW tier opened in
    such a child hung in that setup as it opened (the child killed by its alarm; the parent,
    meanwhile, died of a segmentation fault in a Mooncake thread); now the child knows an
    ancestor set up a client, and each call of the child's tier, and of its own child's, is a
    counted fault at once with a warning that says what to do."""
    with mooncake_master() as master:
        out = _run(_MOONCAKE_CLIENT_SET_UP, """
            fresh = open_tier()
            put = fresh.put(keys(2), blocks)
            got = fresh.get_into(keys(1), [torch.zeros_like(b) for b in blocks])
            print("child", put, got, fresh.num_write_drops > 0, fresh.num_errors > 0, flush=True)
            fresh.close()
            if (grandchild := os.fork()) == 0:  # a fork of a fork: its ancestor set up a client too
                signal.alarm(60)
                again = open_tier()
                print("grandchild", again.put(keys(3), blocks), again.num_errors > 0, flush=True)
                os._exit(0)
            print("grandchild exit", os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1]), flush=True)
        """, master.master, master.metadata_server)
        assert "child 0 0 True True" in out, out
        assert "grandchild 0 True" in out and "grandchild exit 0" in out, out
        assert "open the Mooncake tier in a process that is not a fork" in out, out


def test_a_forked_shared_filesystem_tier_renews_its_locks_and_threads(tmp_path: Path) -> None:
    """Before, the tier renewed nothing: a child forked while a parent's thread held its
    counting lock or its space's hung for ever, and one whose parent's I/O threads had all
    started queued every call for threads it does not have (each a time-out and a pause)."""
    out = _run("""
        from tiers.sharedfs.tier import SharedFSTier
        tier = SharedFSTier(sys.argv[1], 64 << 20, shape, torch.bfloat16, namespace=b"fork-locks", timeout_s=10.0,
                            io_threads=2)
        tier.take_changes()  # the stack takes them: changes are recorded
        assert tier.put(keys(1), blocks) == n and tier.put(keys(3), blocks) == n  # both threads started
        locks = {"tier counts": lambda: tier._count_lock, "writes in flight": lambda: tier._in_flight._lock,
                 "space": lambda: tier.space._lock, "maintenance round": lambda: tier.space._busy}
    """, """
        put = tier.put(keys(2), blocks)
        outs = [torch.zeros_like(b) for b in blocks]
        got = tier.get_into(keys(2), outs)
        same = all(bool((a == b).all()) for a, b in zip(outs, blocks))
        print("child", put, got, same, tier.num_timeouts, flush=True)
    """, str(tmp_path / "shared"))
    assert "child 8 8 True 0" in out, out


def test_renewal_keeps_no_closed_tier_alive(tmp_path: Path) -> None:
    """Every tier registers objects for renewal in a child (`tiers/shared/forks.py`); the
    registry holds them weakly, so 100 tiers of each kind opened and closed leave it no
    larger than one did (a strong reference would keep every tier ever opened alive). A
    guard: it passes before and after this branch."""
    import gc

    import torch

    from tiers.mooncake.client import ClientParams
    from tiers.mooncake.tier import MooncakeTier
    from tiers.remote.tier import RemoteTier
    from tiers.shared import forks
    from tiers.sharedfs.tier import SharedFSTier

    shape = (2, 2, 4, 2, 8)
    master = MooncakeMaster(need_mooncake())  # never started: each setup a counted fault, at once
    params = ClientParams("127.0.0.1", master.metadata_server, 16 << 20, 16 << 20, "tcp", "", master.master)
    with redis_server() as server:
        opens = {
            "sharedfs": lambda: SharedFSTier(str(tmp_path / "s"), 1 << 20, shape, torch.bfloat16, namespace=b"r"),
            "remote": lambda: RemoteTier(server.url, shape, torch.bfloat16, namespace=b"r"),
            "mooncake": lambda: MooncakeTier(params, shape, torch.bfloat16, namespace=b"r", cooldown_s=0.1,
                                             buffer_bytes=1 << 20),
        }
        for kind, open_tier in opens.items():
            open_tier().close()
            gc.collect()
            once = len(forks._RENEW)
            for _ in range(100):
                open_tier().close()
            end = time.monotonic() + 10.0  # a closed tier's idle workers end (and let go of it) soon after
            while gc.collect() >= 0 and len(forks._RENEW) > once and time.monotonic() < end:
                time.sleep(0.05)
            assert len(forks._RENEW) <= once, f"{kind}: {len(forks._RENEW)} objects registered, {once} after one"


def test_a_renewal_that_fails_leaves_the_others_renewed() -> None:
    """An object's `_after_fork` that raises (a thread that cannot start) is warned of; before,
    it ended the renewal, so the locks of every object registered after it stayed held in the
    child (its first call needing one hung)."""
    script = textwrap.dedent("""
        import os, threading
        from tiers.shared.forks import renew_in_child

        class Broken:
            def _after_fork(self):
                raise RuntimeError("can't start new thread")

        class Guarded:
            def __init__(self):
                self._lock = threading.Lock()

        broken, guarded = Broken(), Guarded()
        renew_in_child(broken)
        renew_in_child(guarded, "_lock")
        held = threading.Event()
        threading.Thread(target=lambda: (guarded._lock.acquire(), held.set()), daemon=True).start()
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:
            print("child locked", guarded._lock.locked(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    out = done.stdout + done.stderr
    assert "child locked False" in done.stdout, out
    assert "renewing a Broken in a forked child failed (RuntimeError: can't start new thread)" in done.stderr, out
