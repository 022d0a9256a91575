"""`kvstrata inspect`: a disk tier's contents per namespace, read-only; each damage one line
(exit code 1), never a crash; clear errors otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np
import pytest

from cli import main as kvstrata
from tests import ROOT
from tests.reliability.diskdamage import put_entries
from tests.reliability.kvgen import BLOCK, LAYOUT, make_kv, open_store
from tiers.disk.files import file_name
from tiers.disk.index import unpack_entry


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


# -- damaged tiers: `kvstrata inspect` reports each damage and goes on; it never crashes --------------------------


@pytest.fixture(scope="module")
def sound_tier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed disk tier: namespace model-a with 5 blocks, model-b with 2."""
    path = tmp_path_factory.mktemp("tier") / "disk"
    for name, n in (("model-a", 5), ("model-b", 2)):
        store = open_store(str(path), namespace=name, disk_bytes=32 << 20)
        t = np.arange(n * BLOCK, dtype=np.uint32) + n
        store.store(t, make_kv(t, LAYOUT, BLOCK))
        store.close()
    return path


def damaged_copy(sound: Path, tmp_path: Path) -> Path:
    path = tmp_path / "damaged"
    shutil.copytree(sound, path)
    return path


def run_inspect(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The real `kvstrata inspect`, in its own process (a SIGBUS kills that one, not pytest)."""
    done = subprocess.run([sys.executable, "-m", "cli.main", "inspect", str(path), *extra], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode >= 0, f"killed by signal {-done.returncode}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def damage_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("damage: ")]


def namespace_records(path: Path) -> dict[bytes, dict[str, Any]]:
    with lmdb.open(str(path), max_dbs=8, readonly=True) as env, env.begin(db=env.open_db(b"meta")) as txn:
        return {bytes(k)[3:]: msgpack.unpackb(v) for k, v in txn.cursor() if bytes(k).startswith(b"ns:")}


def put_meta(path: Path, key: bytes, value: bytes) -> None:
    with lmdb.open(str(path), max_dbs=8) as env, env.begin(write=True, db=env.open_db(b"meta")) as txn:
        assert txn.get(key) is not None
        txn.put(key, value)


def test_inspect_of_a_sound_tier_reports_no_damage(sound_tier: Path) -> None:
    done = run_inspect(sound_tier)
    assert done.returncode == 0 and not damage_lines(done), done.stdout
    report = json.loads(run_inspect(sound_tier, "--json").stdout)
    assert report["damage"] == [] and sorted(s["blocks"] for s in report["namespaces"].values()) == [2, 5]


def test_inspect_of_a_truncated_index_reports_it_without_sigbus(sound_tier: Path, tmp_path: Path) -> None:
    path = damaged_copy(sound_tier, tmp_path)
    os.truncate(path / "data.mdb", 3 * 4096)  # the meta pages survive; the pages they name do not
    done = run_inspect(path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = damage_lines(done)
    assert len(lines) == 1 and lines[0].startswith("damage: data.mdb:") and "truncated" in lines[0], done.stdout
    report = json.loads(run_inspect(path, "--json").stdout)
    assert report["namespaces"] == {} and "truncated" in report["damage"][0]["what"]


@pytest.mark.parametrize("record", [msgpack.packb([1, 2, 3]), msgpack.packb("model-b"), b"\xc1\xc1 not msgpack",
                                    msgpack.packb({"identity": 5, "capacity_bytes": "x", "tag": 7}), b""])
def test_inspect_reports_a_damaged_namespace_record_and_goes_on(sound_tier: Path, tmp_path: Path,
                                                                 record: bytes) -> None:
    path = damaged_copy(sound_tier, tmp_path)
    name = next(ns for ns, r in namespace_records(path).items() if r["identity"][0] == "model-b")
    put_meta(path, b"ns:" + name, record)
    done = run_inspect(path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = damage_lines(done)
    assert lines and all(f"namespace {name.hex()}: its " in line for line in lines), done.stdout
    assert all(line.split(": its ", 1)[1].strip() for line in lines)  # each line says what is wrong
    report = json.loads(run_inspect(path, "--json").stdout)
    assert report["namespaces"][name.hex()]["blocks"] == 2  # its blocks still count, under its name
    assert {s["blocks"] for s in report["namespaces"].values()} == {2, 5}
    assert "model-a" in done.stdout  # the sound namespace is reported as before


def test_inspect_reports_damaged_entries_and_payloads_past_their_files(sound_tier: Path, tmp_path: Path) -> None:
    path = damaged_copy(sound_tier, tmp_path)
    with lmdb.open(str(path), max_dbs=8, readonly=True) as env, env.begin(db=env.open_db(b"index")) as txn:
        entries = {bytes(k): unpack_entry(v) for k, v in txn.cursor()}
    first = min(entries, key=lambda k: entries[k].slot)
    put_entries(path, {first: b"\x02 not an entry"})
    last = max(entries, key=lambda k: entries[k].slot)
    data = path / file_name(entries[last].slot_bytes)
    os.truncate(data, entries[last].slot * entries[last].slot_bytes + 1)  # the last payload, cut short
    done = run_inspect(path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = damage_lines(done)
    assert len(lines) == 2, done.stdout
    assert first.hex() in lines[0] or first.hex() in lines[1]
    assert any(last.hex() in line and file_name(entries[last].slot_bytes) in line for line in lines)
    report = json.loads(run_inspect(path, "--json").stdout)
    assert sum(s["blocks"] for s in report["namespaces"].values()) == 5
    assert sum(s["damaged_blocks"] for s in report["namespaces"].values()) == 2
    data.unlink()  # every payload's file gone: each block is one line
    done = run_inspect(path)
    assert done.returncode == 1 and len(damage_lines(done)) == 7 and "missing" in done.stdout, done.stdout
