"""`kvstrata inspect`: a disk tier's contents per namespace, read-only; clear errors otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli import main as kvstrata
from tests import ROOT
from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv, open_store


def test_inspect_shows_each_namespace_while_a_store_is_open(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = open_store(str(tmp_path), namespace="model-a", disk_bytes=32 << 20)
    b = open_store(str(tmp_path), namespace="model-b", disk_bytes=32 << 20)
    for store, n in ((a, 5), (b, 2)):
        t = np.arange(n * BLOCK, dtype=np.uint32) + n
        store.store(t, make_kv(t, LAYOUT, BLOCK))
    b.close()
    try:  # a is still open in this process: inspect, its own process as a user runs it, reads beside it
        done = subprocess.run([sys.executable, "-m", "cli.main", "inspect", str(tmp_path), "--json"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        by_name = {s["identity"][0]: s for s in report["namespaces"].values()}
        assert by_name["model-a"]["blocks"] == 5 and by_name["model-b"]["blocks"] == 2
        assert by_name["model-a"]["capacity_bytes"] == 32 << 20
        assert by_name["model-a"]["oldest_tick"] <= by_name["model-a"]["newest_tick"]
    finally:
        a.close()
    assert kvstrata.main(["inspect", str(tmp_path)]) == 0
    assert "model-a" in capsys.readouterr().out


def test_inspect_refuses_missing_and_foreign_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        assert kvstrata.main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0]
