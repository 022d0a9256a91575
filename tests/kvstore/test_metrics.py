"""Prometheus metrics of a store: per-tier families with tier labels, latency histograms."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore import ConfigError, KVCacheStore, StoreConfig
from kvstore.metrics import register_metrics
from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_metrics_follow_the_store_with_tier_labels(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, namespace="metrics", pool_blocks=4, pool_device="cpu",
                      cpu_bytes=4 * LAYOUT.block_bytes(BLOCK), disk_path=str(tmp_path / "d"),
                      disk_bytes=16 << 20, disk_sync=False)
    with KVCacheStore(cfg) as store:
        register_metrics(store, registry)
        tokens = np.arange(12 * BLOCK, dtype=np.uint32)
        store.store(tokens, make_kv(tokens, LAYOUT, BLOCK))  # 12 blocks: pool 4, the rest demoted down
        store.retrieve(tokens)
        store.lookup(tokens)
        other = np.arange(10_000, 10_000 + 4 * BLOCK, dtype=np.uint32)
        store.store(other, make_kv(other, LAYOUT, BLOCK))  # takes the pool: its blocks are evicted down
        text = prometheus_client.generate_latest(registry).decode()
        ns = bytes(store.seed).hex()[:8]
        for tier in ("pool", "cpu", "disk"):
            assert _value(text, "kvstrata_capacity_bytes", tier=tier, namespace=ns) > 0
        served = sum(_value(text, "kvstrata_hit_tokens_total", tier=t) for t in ("pool", "cpu", "disk"))
        assert served == _value(text, "kvstrata_hit_tokens_all_total") == 12 * BLOCK
        assert _value(text, "kvstrata_blocks_evicted_total", tier="pool") > 0
        assert _value(text, "kvstrata_lookups_total") == 1
        assert _value(text, "kvstrata_blocks_stored_total", tier="disk") > 0
        assert _value(text, "kvstrata_latency_seconds_count", op="store") == 2
        assert _value(text, "kvstrata_latency_seconds_count", op="retrieve") == 1


def _config(path: Path, namespace: str = "metrics", **kw: object) -> StoreConfig:
    return StoreConfig(LAYOUT, block_size=BLOCK, namespace=namespace, cpu_bytes=8 * LAYOUT.block_bytes(BLOCK),
                       disk_path=str(path), disk_bytes=16 << 20, disk_sync=False, **kw)  # type: ignore[arg-type]


def test_two_stores_in_one_process_export_side_by_side(tmp_path: Path) -> None:
    """Two stores of one model in one registry (two engines, or a scheduler's and a worker's
    store) are told apart by the `store` label; each family appears once in the exposition."""
    registry = prometheus_client.CollectorRegistry(auto_describe=True)  # as the default REGISTRY
    with KVCacheStore(_config(tmp_path / "a")) as a, KVCacheStore(_config(tmp_path / "b")) as b:
        names = register_metrics(a, registry), register_metrics(b, registry)
        assert names == ("store", "store-2")
        tokens = np.arange(3 * BLOCK, dtype=np.uint32)
        a.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        a.lookup(tokens)
        b.lookup(tokens)
        b.lookup(tokens)
        text = prometheus_client.generate_latest(registry).decode()
        ns = bytes(a.seed).hex()[:8]
        assert _value(text, "kvstrata_lookups_total", namespace=ns, store="store") == 1
        assert _value(text, "kvstrata_lookups_total", namespace=ns, store="store-2") == 2
        assert _value(text, "kvstrata_blocks", store="store", tier="cpu") == 3
        assert _value(text, "kvstrata_blocks", store="store-2", tier="cpu") == 0
        assert _value(text, "kvstrata_latency_seconds_count", store="store", op="store") == 1
        families = [f.name for f in text_string_to_metric_families(text)]
        assert len(families) == len(set(families)) and "kvstrata_lookups" in families


def test_registering_a_store_twice_is_idempotent_and_names_are_checked(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    with KVCacheStore(_config(tmp_path / "a", instance_id="engine-0")) as a, \
            KVCacheStore(_config(tmp_path / "b")) as b:
        assert register_metrics(a, registry) == "engine-0"  # the configured instance_id
        assert register_metrics(a, registry) == "engine-0"  # again: the same registration
        with pytest.raises(ConfigError, match="'engine-0' is already registered"):
            register_metrics(b, registry, name="engine-0")
        with pytest.raises(ConfigError, match="already registered as 'engine-0'"):
            register_metrics(a, registry, name="other")
        assert register_metrics(b, registry, name="worker") == "worker"
        tokens = np.arange(BLOCK, dtype=np.uint32)
        a.store(tokens, make_kv(tokens, LAYOUT, BLOCK))
        text = prometheus_client.generate_latest(registry).decode()
        assert _value(text, "kvstrata_latency_seconds_count", store="engine-0", op="store") == 1  # counted once
        assert _value(text, "kvstrata_store_calls_total", store="worker") == 0
    # closed stores leave the exposition, and a reopened engine takes its name again
    with KVCacheStore(_config(tmp_path / "a", instance_id="engine-0")) as again:
        assert register_metrics(again, registry) == "engine-0"
        text = prometheus_client.generate_latest(registry).decode()
        assert 'store="worker"' not in text
        assert _value(text, "kvstrata_store_calls_total", store="engine-0") == 0
    with KVCacheStore(_config(tmp_path / "c")) as unnamed, pytest.raises(ConfigError, match="name"):
        register_metrics(unnamed, registry, name="")


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a socket listening on `port` (Linux /proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":  # LISTEN
                found.add(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_the_connectors_metrics_port_binds_loopback_by_default(tmp_path: Path) -> None:
    """`metrics_port` serves on 127.0.0.1 unless `metrics_host` says otherwise: a listening
    socket is never open to other hosts by default."""
    pytest.importorskip("prometheus_client")
    from cli.ports import free_port
    from engine_adapter.vllm.metrics_server import serve_metrics

    port = free_port()
    with KVCacheStore(StoreConfig(LAYOUT, block_size=BLOCK, cpu_bytes=4 * LAYOUT.block_bytes(BLOCK))) as store:
        assert serve_metrics(store, port)
        assert _listening_addresses(port) == {"127.0.0.1"}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"kvstrata_blocks" in reply.read()


def test_tenant_quotas_are_exported_per_tenant_under_hashed_labels() -> None:
    """A CPU tier with tenant quotas exports each tenant's blocks, quota, hits, writes and
    evictions under a label that is a hash of its cache salt, never the salt itself."""
    from kvstore.hashing import ExtraKeys
    from tiers.policies.quota import tenant_label

    registry = prometheus_client.CollectorRegistry()
    block_bytes = LAYOUT.block_bytes(BLOCK)
    cfg = StoreConfig(LAYOUT, block_size=BLOCK, namespace="tenants", cpu_bytes=8 * block_bytes,
                      cpu_tenant_quota_bytes=4 * block_bytes)
    with KVCacheStore(cfg) as store:
        register_metrics(store, registry)
        a = np.arange(3 * BLOCK, dtype=np.uint32)
        store.store(a, make_kv(a, LAYOUT, BLOCK), extra_keys=ExtraKeys(cache_salt="secret-salt-a"))
        store.retrieve(a, extra_keys=ExtraKeys(cache_salt="secret-salt-a"))
        for start in range(0, 40 * BLOCK, 4 * BLOCK):  # tenant B floods the tier; A keeps using its blocks
            b = np.arange(50_000 + start, 50_000 + start + 4 * BLOCK, dtype=np.uint32)
            store.store(b, make_kv(b, LAYOUT, BLOCK), extra_keys=ExtraKeys(cache_salt="secret-salt-b"))
            assert store.retrieve(a, extra_keys=ExtraKeys(cache_salt="secret-salt-a")).num_tokens == 3 * BLOCK
        text = prometheus_client.generate_latest(registry).decode()
        assert "secret" not in text
        shares = {t.label: t for t in store.stats().tiers[0].tenants}
        assert len(shares) == 2
        held = {label: _value(text, "kvstrata_tenant_blocks", tier="cpu", tenant=label) for label in shares}
        assert sorted(held.values()) == [3.0, 5.0]  # A keeps its 3 blocks within its quota of 4; B the rest
        for label, share in shares.items():
            assert held[label] == share.num_blocks
            assert _value(text, "kvstrata_tenant_quota_blocks", tenant=label) == 4
            assert _value(text, "kvstrata_tenant_blocks_stored_total", tenant=label) == share.num_puts
        hits = sorted(_value(text, "kvstrata_tenant_hits_total", tenant=label) for label in shares)
        assert hits == [0.0, 33.0]  # only A read: 11 times 3 blocks
        evicted = sorted(_value(text, "kvstrata_tenant_blocks_evicted_total", tenant=label) for label in shares)
        assert evicted == [0.0, 35.0]  # B's own flood, never A's blocks
        assert all(len(label) == 16 for label in shares)
        assert tenant_label(b"secret-salt-a") not in ("", "default")
