"""The Mooncake tier against a real `mooncake_master` on loopback (TCP transport, no mocks).

Two processes standing for two hosts, each with its own CPU tier, share a prefix bit-exact
through the store; namespaces never see each other's blocks; a damaged record written through
the raw client is a counted miss and is removed; a killed master makes counted misses within
a bounded time, and the tier recovers when it is back; the tier works from config alone, also
through the vLLM connector's `tiers`; without the extra, opening it is one error naming it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore import KVCacheStore, StoreConfig
from kvstore.errors import ConfigError
from tests import ROOT
from tests.mooncake_fixtures import MooncakeMaster, mooncake_master, need_mooncake
from tests.reliability.kvgen import BLOCK, LAYOUT, check_kv, make_kv
from tests.tiers.shared_tiers import last_tier, shared_stored_events
from tests.tiers.shared_tiers import prompt_tokens as _tokens
from tiers.keys import TierKind
from tiers.mooncake.client import close_idle
from tiers.mooncake.tier import MooncakeTier
from tiers.tier_config import tier_config

MOONCAKE = TierKind("mooncake")


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with mooncake_master() as m:
        yield m


def _store(tier: dict[str, Any], *, namespace: str = "mooncake-test", cpu_blocks: int = 16) -> KVCacheStore:
    cpu = {"type": "cpu", "capacity_bytes": cpu_blocks * LAYOUT.block_bytes(BLOCK)}
    tiers: list[object] = [cpu] if cpu_blocks else []
    return KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, namespace=namespace, tiers=[*tiers, tier]))


def _mooncake(store: KVCacheStore) -> MooncakeTier:
    return last_tier(store, MooncakeTier)


@pytest.fixture(scope="module")
def raw(master: MooncakeMaster) -> Iterator[Any]:
    """Mooncake's own client (no segment of its own), as another program on the cluster;
    closed before the master stops."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", master.metadata_server, 0, 16 << 20, "tcp", "", master.master) == 0
    yield client
    client.close()


_HOST_A = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv
    from tests.tiers.test_mooncake import _store, _tokens
    store = _store(json.loads(sys.argv[1]))
    for seed in range(4):
        t = _tokens(6, seed)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
    print(json.dumps({"puts": store.tiers[-1].stats().num_puts}), flush=True)
    sys.stdin.readline()  # its segment holds blocks: it stays until host B has read them
    store.close()
    """
)


def test_two_hosts_share_a_prefix_bit_exact(master: MooncakeMaster) -> None:
    import json

    host_a = subprocess.Popen([sys.executable, "-c", _HOST_A, json.dumps(master.tier()), str(ROOT)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert host_a.stdout is not None and host_a.stdin is not None
        line = host_a.stdout.readline()
        assert line, host_a.stderr.read()[-3000:] if host_a.stderr else ""
        assert json.loads(line)["puts"] >= 24  # and again as the CPU tier demotes (a put of a held key is kept)
        with _store(master.tier()) as store:  # host B: its own, empty CPU tier
            for seed in range(4):
                t = _tokens(6, seed)
                res = store.retrieve(t)
                assert res.num_tokens == len(t) and res.blocks_per_tier == {MOONCAKE: 6}
                check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
            local = store.retrieve(_tokens(6, 3)).blocks_per_tier  # the last, promoted into B's CPU tier
            assert local == {TierKind.CPU: 6}
            store.check_integrity()
        host_a.stdin.write("\n")
        host_a.stdin.flush()
        assert host_a.wait(60) == 0
    finally:
        host_a.kill()


def test_namespaces_never_see_each_other(master: MooncakeMaster) -> None:
    t = _tokens(4, 1)
    with _store(master.tier(), namespace="model-a", cpu_blocks=0) as a, \
            _store(master.tier(), namespace="model-b", cpu_blocks=0) as b:
        a.store(t, make_kv(t, LAYOUT, BLOCK))
        assert a.lookup(t) == len(t)
        assert b.lookup(t) == 0 and b.retrieve(t).num_tokens == 0
        b.clear()  # clears only model-b's blocks
        assert a.lookup(t) == len(t)
        with _store(master.tier(), namespace="model-a", cpu_blocks=0) as a2:
            assert a2.retrieve(t).num_tokens == len(t)
            a.clear()  # a new generation: no store of model-a finds the old blocks
            assert a2.lookup(t) == 0 and a2.retrieve(t).num_tokens == 0


@pytest.mark.parametrize("damage", ["garbage", "flip-payload", "other-key", "longer-than-a-region"])
def test_a_damaged_record_is_a_counted_miss_and_removed(master: MooncakeMaster, raw: Any, damage: str) -> None:
    t, other = _tokens(4, 2), _tokens(4, 3)
    with _store(master.tier(), namespace=f"damage-{damage}", cpu_blocks=0) as store:
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        store.store(other, make_kv(other, LAYOUT, BLOCK))
        tier = _mooncake(store)
        key = tier.server_key(store.block_hashes(t)[2])
        value = raw.get(key)
        assert len(value) > LAYOUT.block_bytes(BLOCK)
        if damage == "garbage":
            bad = b"not a record at all" * 7
        elif damage == "longer-than-a-region":  # no record of this layout is: never read
            bad = b"x" * (3 << 20)
        elif damage == "flip-payload":
            bad = value[:-5] + bytes([value[-5] ^ 0x10]) + value[-4:]
        else:  # a sound record of another block under this key
            bad = raw.get(tier.server_key(store.block_hashes(other)[2]))
        assert raw.upsert(key, bad) == 0
        res = store.retrieve(t)
        assert res.num_tokens == 2 * BLOCK  # stops before the damaged block: no hole
        check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
        assert tier.stats().num_corrupt == 1 and tier.num_errors == 0
        assert raw.batch_is_exist([key]) == [0], "a damaged record was not removed"
        store.store(t, make_kv(t, LAYOUT, BLOCK))  # written again, whole
        res = store.retrieve(t)
        assert res.num_tokens == len(t)
        check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)


def test_a_killed_master_is_a_bounded_counted_miss_and_the_tier_recovers() -> None:
    with mooncake_master() as master, _store(master.tier(timeout_s=0.5, cooldown_s=0.5)) as store:
        tier = _mooncake(store)
        t = _tokens(4, 4)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        master.kill()
        started = time.monotonic()
        for seed in range(10, 14):  # stores keep working locally; the Mooncake writes are dropped
            u = _tokens(4, seed)
            store.store(u, make_kv(u, LAYOUT, BLOCK))
            res = store.retrieve(u)
            assert res.num_tokens == len(u)
            check_kv(u, res.kv, res.num_tokens, LAYOUT, BLOCK)
        store.tiers[0].clear()  # only the dead store could serve t now: a miss, no exception
        assert store.lookup(t) == 0 and store.retrieve(t).num_tokens == 0
        assert time.monotonic() - started < 20, "calls against a dead master were not bounded"
        assert tier.num_errors > 0 and tier.num_write_drops > 0
        master.start()  # back on the same ports, empty: the clients mount their segments again
        v = _tokens(4, 30)
        deadline = time.monotonic() + 30
        while tier.match_prefix(store.block_hashes(v)) < len(v) // BLOCK:
            assert time.monotonic() < deadline, "the mooncake tier did not recover"
            time.sleep(0.3)
            store.tiers[0].clear()
            store.store(v, make_kv(v, LAYOUT, BLOCK))  # the CPU tier emptied: the put reaches Mooncake
        store.tiers[0].clear()
        res = store.retrieve(v)
        assert res.blocks_per_tier == {MOONCAKE: 4}
        check_kv(v, res.kv, res.num_tokens, LAYOUT, BLOCK)


def test_a_master_down_at_open_is_a_bounded_miss_and_the_tier_sets_up_when_it_starts() -> None:
    """Mooncake's setup holds the interpreter's lock while it retries a dead master (minutes):
    the tier first checks that the master answers, so opening never hangs."""
    master = MooncakeMaster(need_mooncake())  # not started yet
    try:
        started = time.monotonic()
        with _store(master.tier(cooldown_s=0.2)) as store:
            assert time.monotonic() - started < 15, "opening against a dead master was not bounded"
            tier = _mooncake(store)
            t = _tokens(4, 5)
            store.store(t, make_kv(t, LAYOUT, BLOCK))  # kept locally; the Mooncake write is a counted fault
            store.tiers[0].clear()
            assert store.retrieve(t).num_tokens == 0 and tier.num_errors > 0
            master.start()
            deadline = time.monotonic() + 30
            while tier.match_prefix(store.block_hashes(t)) < len(t) // BLOCK:
                assert time.monotonic() < deadline, "the mooncake tier did not set up once the master started"
                time.sleep(0.3)
                store.store(t, make_kv(t, LAYOUT, BLOCK))
                store.tiers[0].clear()
            res = store.retrieve(t)
            assert res.blocks_per_tier == {MOONCAKE: 4}
            check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
    finally:
        close_idle()
        master.kill()


def test_events_announce_its_blocks_as_shared_naming_the_master(master: MooncakeMaster) -> None:
    """As the remote tier's: the shared trait makes its blocks SHARED for routers (every host
    reads them), and the source names the master, so routers tell which instances share them."""
    from cli.ports import free_port_pair
    from tests.kvstore.test_events import Reader

    port = free_port_pair()
    tier = master.tier()
    config = StoreConfig(LAYOUT, block_size=BLOCK, namespace="mooncake-events", events_endpoint=f"tcp://127.0.0.1:{port}",
                         tiers=[{"type": "cpu", "capacity_bytes": 16 * LAYOUT.block_bytes(BLOCK)}, tier])
    with KVCacheStore(config) as store:
        reader = Reader(port)
        try:
            reader.drain(1.0)
            stored = shared_stored_events(store, reader, _tokens(3, 6))
            assert all(e["kvstrata"]["remote"] == f"mooncake://{master.master}" for e in stored)
        finally:
            reader.close()


def test_config_alone_and_through_the_vllm_connector(master: MooncakeMaster) -> None:
    from engine_adapter.vllm.settings import ConnectorSettings
    from engine_adapter.vllm.store_config import Derived, group_config

    config = tier_config(master.tier(segment_bytes=0))
    assert config.segment_bytes == 0  # type: ignore[attr-defined]
    settings = ConnectorSettings.from_sources({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20},
                                                         master.tier()]}, {})
    derived = Derived(LAYOUT, BLOCK, "{}", head_size=64, kv_dtype=LAYOUT.dtype)
    assert [type(c).__name__ for c in group_config(settings, derived).tier_configs] == \
        ["CPUTierConfig", "MooncakeTierConfig"]
    for bad, field in [({"master": "nohost"}, "master"), ({"protocol": "udp"}, "protocol"),
                       ({"timeout_s": 0}, "timeout_s"), ({"segment_bytes": -1}, "segment_bytes"),
                       ({"buffer_bytes": 1024}, "buffer_bytes")]:
        with pytest.raises(ConfigError, match=field):
            tier_config(master.tier(**bad))


def test_without_the_extra_opening_is_one_error_naming_it(master: MooncakeMaster,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Registering the built-in tiers imports the tier's modules, never Mooncake's client.
    probe = "import sys, tiers.tier_config as t; t.TIERS.names(); print(sorted(m.split('.')[0] for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "'tiers'" in out.stdout and "'mooncake'" not in out.stdout, out
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"kvstrata\[mooncake\]"):
        _store(master.tier())


def test_a_record_longer_than_its_first_slot_is_read_not_removed(master: MooncakeMaster) -> None:
    """A writer with KV events carries each block's extras in its records (a long LoRA name
    here): a reader without events, or with them, reads them whole, never takes them for
    damaged ones (it did: counted corrupt and removed)."""
    from cli.ports import free_port_pair
    from kvstore.hashing import ExtraKeys

    extras = ExtraKeys(lora_id="adapter-" + "x" * 6000)
    t = _tokens(6, 7)
    config = StoreConfig(LAYOUT, block_size=BLOCK, namespace="mooncake-extras", tiers=[master.tier()],
                         events_endpoint=f"tcp://127.0.0.1:{free_port_pair()}")
    with KVCacheStore(config) as writer:
        writer.store(t, make_kv(t, LAYOUT, BLOCK), extra_keys=extras)
        with _store(master.tier(), namespace="mooncake-extras", cpu_blocks=0) as reader:
            for store in (reader, writer):
                res = store.retrieve(t, extra_keys=extras)
                assert res.num_tokens == len(t) and res.blocks_per_tier == {MOONCAKE: 6}
                check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)
                assert _mooncake(store).stats().num_corrupt == 0 and _mooncake(store).num_errors == 0
            assert reader.lookup(t, extra_keys=extras) == len(t)


def test_a_client_kept_for_an_abandoned_call_is_reused_once_the_call_returns() -> None:
    """A tier closed while a call that passed its deadline still runs keeps its client and
    transfer buffer aside; once the call returns, the next tier of that setup takes them (they
    were kept until exit: a buffer of `buffer_bytes` lost at each such close)."""
    with mooncake_master() as master:
        store = _store(master.tier(timeout_s=0.3), cpu_blocks=0)
        t = _tokens(2, 8)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        regions = _mooncake(store)._conn.regions
        master.pause()
        try:
            assert store.retrieve(t).num_tokens == 0  # abandoned: the call holds its region
            assert regions.num_free < 2
            store.close()
        finally:
            master.resume()
        deadline = time.monotonic() + 30
        while regions.num_free < 2:
            assert time.monotonic() < deadline, "the abandoned call did not return once the master ran on"
            time.sleep(0.1)
        with _store(master.tier(timeout_s=0.3), cpu_blocks=0) as again:
            assert _mooncake(again)._conn.regions is regions, "the client and buffer kept aside were never reused"
            res = again.retrieve(t)
            assert res.num_tokens == len(t)
            check_kv(t, res.kv, res.num_tokens, LAYOUT, BLOCK)


_HUNG_OPEN = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv
    from tests.tiers.test_mooncake import _mooncake, _store, _tokens
    from tiers.mooncake.client import close_idle
    started = time.monotonic()
    store = _store(json.loads(sys.argv[1]), cpu_blocks=0)
    t = _tokens(2, 9)
    store.store(t, make_kv(t, LAYOUT, BLOCK))
    print(json.dumps({"open_s": time.monotonic() - started, "hits": store.lookup(t),
                      "errors": _mooncake(store).num_errors}), flush=True)
    sys.stdin.readline()  # the master runs on
    deadline = time.monotonic() + 30
    while store.lookup(t) < len(t) and time.monotonic() < deadline:
        time.sleep(0.3)
        store.store(t, make_kv(t, LAYOUT, BLOCK))
    print(json.dumps({"hits": store.lookup(t)}), flush=True)
    store.close()
    close_idle()
    """
)


def test_a_hung_master_at_open_is_a_bounded_miss_not_a_hung_process() -> None:
    """A master that accepts connections but answers nothing (stopped: the kernel still
    accepts) made Mooncake's setup hold the interpreter's lock for good: the whole process
    hung. The tier asks the master for an answer before a setup, so it is a counted fault,
    and it sets up once the master runs on."""
    import json

    with mooncake_master() as master:
        master.pause()
        child = subprocess.Popen([sys.executable, "-c", _HUNG_OPEN, json.dumps(master.tier(setup_timeout_s=3.0,
                                                                                            cooldown_s=0.2)),
                                  str(ROOT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
        try:
            assert child.stdout is not None and child.stdin is not None
            first = _line_within(child, 60)
            assert first is not None, "opening a tier against a hung master hung the process"
            opened = json.loads(first)
            assert opened["open_s"] < 30 and opened["hits"] == 0 and opened["errors"] > 0, opened
            master.resume()
            child.stdin.write("\n")
            child.stdin.flush()
            second = _line_within(child, 90)
            assert second is not None and json.loads(second)["hits"] == 2 * BLOCK, second
            assert child.wait(60) == 0
        finally:
            master.resume()
            child.kill()
            child.wait(10)


def _line_within(child: subprocess.Popen[str], timeout_s: float) -> str | None:
    """The next line `child` prints, or None if none comes within `timeout_s`."""
    import threading

    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(child.stdout.readline() if child.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return got[0] if got and got[0] else None
