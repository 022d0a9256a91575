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
