"""A real third-party reader of kvstrata's KV events: NVIDIA Dynamo's standalone KV indexer
(`python -m dynamo.indexer`, from `.venv-dynamo`: `bash scripts/setup_dynamo.sh`), subscribed
to kvstrata stores in their own processes, reports per instance the same longest prefix as
each store's own lookup, with CPU-tier blocks in its host tier and disk blocks in its lower
tier; evictions disappear and a restart over a warm disk is announced, without what the
disk lost while the store was down."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.ports import free_port
from tests import ROOT
from tests.conftest import BLOCK
from tests.router.test_router import Instance, discard_from_disk, doc, wait_for
from tests.switches import switches

pytestmark = pytest.mark.dynamo
DYNAMO = ROOT / ".venv-dynamo" / "bin" / "python"


class Indexer:
    """Dynamo's standalone indexer on a loopback port."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / "dynamo.log", "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen([str(DYNAMO), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
        wait_for(lambda: self._up(), "Dynamo's indexer to serve HTTP", timeout=60)

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/workers", timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError):
            return False

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def register(self, worker: int, inst: Instance) -> None:
        self.post("/register", {"instance_id": worker, "endpoint": inst.endpoint, "model_name": "m",
                                "block_size": BLOCK})

    def query(self, tokens: list[int]) -> dict[str, Any]:
        return self.post("/query", {"token_ids": tokens, "model_name": "m"})["instances"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    if not DYNAMO.exists():
        if switches().require_dynamo:
            pytest.fail(f"{DYNAMO} is missing: run scripts/setup_dynamo.sh (KVSTRATA_TEST_REQUIRE_DYNAMO is set)")
        pytest.skip("Dynamo's indexer is not installed: bash scripts/setup_dynamo.sh")
    made = Indexer(tmp_path)
    yield made
    made.stop()


def dynamo_view(where: list[str]) -> dict[str, int]:
    """What Dynamo's query reports for a store whose `where` is the tier of each block of its
    cached prefix: the longest prefix, and how far it reaches through the host tier alone
    (its lower tiers extend it)."""
    host = next((i for i, tier in enumerate(where) if tier != "cpu"), len(where))
    return {"longest_matched": len(where) * BLOCK, "gpu": 0, "cpu": host * BLOCK, "disk": len(where) * BLOCK}


def expect(index: Indexer, tokens: list[int], truth: dict[int, list[str]]) -> None:
    """Wait until Dynamo's answer for each worker equals `dynamo_view` of its store's truth."""
    last: dict[str, Any] = {}

    def agrees() -> bool:
        nonlocal last
        last = index.query(tokens)
        views = {w: {k: last.get(str(w), {}).get(k, 0) for k in ("longest_matched", "gpu", "cpu", "disk")}
                 for w in truth}
        return all(views[w] == dynamo_view(where) for w, where in truth.items())

    try:
        wait_for(agrees, "Dynamo's indexer to agree with the stores", timeout=20)
    except AssertionError:
        raise AssertionError(f"dynamo: {last}; stores: {truth}") from None


def test_dynamos_indexer_sees_what_each_store_holds(indexer: Indexer, tmp_path: Path) -> None:
    from cli.ports import free_port_pair

    made: list[Instance] = []
    try:
        a = Instance("a", free_port_pair(), tmp_path / "a", 6)
        b = Instance("b", free_port_pair(), tmp_path / "b", 64)
        made += [a, b]
        indexer.register(1, a)
        indexer.register(2, b)
        long_doc = doc(1, 10)
        a.call("store", long_doc)  # 10 blocks into 6 CPU slots: the tail goes to disk
        b.call("store", long_doc[: 4 * BLOCK])
        truth = {1: a.call("where", long_doc), 2: b.call("where", long_doc)}
        assert "disk" in truth[1] and truth[2] == ["cpu"] * 4
        expect(indexer, long_doc, truth)
        # evictions disappear: a second document pushes the first out of a diskless store
        c = Instance("c", free_port_pair(), None, 4)
        made.append(c)
        indexer.register(3, c)
        first, second = doc(2, 4), doc(3, 4)
        c.call("store", first)
        expect(indexer, first, {3: ["cpu"] * 4})
        c.call("store", second)  # evicts all of `first` (no disk below)
        expect(indexer, first, {3: []})
        expect(indexer, second, {3: ["cpu"] * 4})
        # a restart over a warm disk: the store clears its old state and announces the disk
        # (Dynamo's subscription reconnects by itself, and takes the new lifetime's batches)
        a = a.restart()
        made.append(a)
        truth[1] = a.call("where", long_doc)
        assert truth[1] == ["disk"] * 10
        expect(indexer, long_doc, {1: truth[1], 2: truth[2]})
    finally:
        for inst in made:
            if inst.proc.poll() is None:
                inst.kill()


def test_a_restarted_store_makes_dynamo_forget_what_its_disk_lost(indexer: Indexer, tmp_path: Path) -> None:
    """A store announces blocks and stops; while it is down another process evicts some from
    its disk; it restarts. Dynamo's indexer, still subscribed, no longer shows the evicted
    blocks (and still shows the rest): a starting store clears what its readers knew of it
    (vLLM's `AllBlocksCleared`) in batches numbered above its last lifetime's, which Dynamo
    would otherwise drop as already seen."""
    from cli.ports import free_port_pair

    a = Instance("a", free_port_pair(), tmp_path / "a", 4)
    made = [a]
    try:
        indexer.register(1, a)
        gone, kept = doc(1, 4), doc(2, 4)
        a.call("store", gone)
        a.call("store", kept)  # 4 CPU slots: `gone` is demoted to disk
        expect(indexer, gone, {1: a.call("where", gone)})
        expect(indexer, kept, {1: a.call("where", kept)})
        time.sleep(3)  # a lifetime of some batches (a heartbeat a second), as any store's
        a.close()  # persists the CPU tier: both on disk
        discard_from_disk(tmp_path / "a", gone)
        a = a.restart()
        made.append(a)
        assert a.call("where", gone) == [] and a.call("where", kept) == ["disk"] * 4
        expect(indexer, gone, {1: []})
        expect(indexer, kept, {1: ["disk"] * 4})
    finally:
        for inst in made:
            if inst.proc.poll() is None:
                inst.kill()


# Media and localities NVIDIA Dynamo 1.6.1's indexer takes (measured against it: any other
# medium, lower-case ones included, and locality "REMOTE" are dropped; vLLM 0.33 added
# "STORAGE", which 1.6.1 counts in its disk tier). kvstrata sends no locality (None:
# unspecified, which 1.6.1 takes as local).
DYNAMO_161_MEDIA = frozenset({"GPU", "CPU", "DISK", "SHARED", "STORAGE", "EXTERNAL"})
DYNAMO_161_LOCALITIES = frozenset({None, "LOCAL"})


def kvstrata_media() -> set[str]:
    """The medium of every tier there can be: a tier's medium follows from its traits alone
    (`kvevents.wire.medium_of`), so every combination covers tiers added later too."""
    from itertools import product

    from kvevents.wire import medium_of
    from tiers.base import TierTraits

    return {medium_of(TierTraits(engine_memory=e, memory=m, persistent=p, shared=s))
            for e, m, p, s in product((False, True), repeat=4)}


def kvstrata_events(tokens: list[int], medium: str) -> list[dict[str, Any]]:
    """The events kvstrata's wire format builds for `tokens`' blocks held in `medium`: stored,
    removed, cleared."""
    import numpy as np
    import torch

    from kvevents.wire import cleared_event, removed_event, stored_events
    from kvstore import KVCacheStore, StoreConfig
    from kvstore.config import KVLayout

    store = KVCacheStore(StoreConfig(layout=KVLayout(1, 1, 8, torch.float16), block_size=BLOCK, cpu_bytes=1 << 20))
    try:
        keys = [k._replace(extras=b"") for k in store.keys(np.asarray(tokens, dtype=np.uint32))]
        return [*stored_events([(k, medium) for k in keys], store.chain().seed, BLOCK, {}),
                removed_event([keys[0].block_hash], medium, {}), cleared_event([medium], {})]
    finally:
        store.close()


def test_every_tier_announces_a_medium_and_locality_dynamo_161_takes() -> None:
    """Without Dynamo: every tier's medium is one 1.6.1 takes, and no event kvstrata builds
    names a locality."""
    assert kvstrata_media() <= DYNAMO_161_MEDIA
    for medium in kvstrata_media():
        for event in kvstrata_events(doc(1, 2), medium):
            assert event.get("locality") in DYNAMO_161_LOCALITIES
            assert event.get("medium", medium) in DYNAMO_161_MEDIA


def test_dynamos_indexer_takes_the_events_of_every_tier(indexer: Indexer) -> None:
    """The real 1.6.1 indexer indexes `BlockStored` events as kvstrata builds them in every
    medium a tier can have; the same events with locality "REMOTE", or a medium it does not
    know, are dropped (the check can fail)."""
    import msgpack
    import zmq

    from kvevents.wire import encode_batch

    port = free_port()
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        indexer.post("/register", {"instance_id": 9, "endpoint": f"tcp://127.0.0.1:{port}", "model_name": "m",
                                   "block_size": BLOCK})
        cases = [(medium, None) for medium in sorted(kvstrata_media())] + [("CPU", "REMOTE"), ("DISKS", None)]
        events, docs = [], []
        for i, (medium, locality) in enumerate(cases):
            docs.append(doc(100 + i, 2))
            stored = kvstrata_events(docs[-1], medium)[0]
            assert stored["type"] == "BlockStored" and len(stored["block_hashes"]) == 2
            if locality is not None:
                stored["locality"] = locality
            events.append(stored)
        payload = encode_batch(events)
        assert msgpack.unpackb(payload)[1] == events

        def indexed() -> list[int]:
            seq = time.time_ns() // 1000
            sock.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])  # until the subscription is up
            return [indexer.query(tokens).get("9", {}).get("longest_matched", 0) for tokens in docs]

        wait_for(lambda: all(indexed()[: len(kvstrata_media())]), "Dynamo to index every tier's events", timeout=30)
        assert indexed() == [2 * BLOCK] * len(kvstrata_media()) + [0, 0]
    finally:
        sock.close(linger=0)
