"""The demos' working folders: kvstrata deletes only what it made.

Each demo keeps its data in `<--disk-path>/<demo name>`, a folder it creates and marks; a
rerun replaces only that folder. Files of the user's under `--disk-path`, a folder of the
demo's name that kvstrata did not make, a file or a link there are never deleted (the demo
refuses with one line and exit code 2), and the demos' default folders are distinct.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli import main as kvstrata
from cli.demo_dir import MARKER, DemoDirError, prepare
from tests.redis_fixtures import need_redis

TINY = {
    "demo": ["demo", "--doc-tokens", "128", "--question-tokens", "4"],
    "demo-store": ["demo-store", "--tokens", "256", "--layers", "1", "--cpu-mib", "1"],
    "demo-remote": ["demo-remote", "--tokens", "256"],
}


def _user_files(root: Path) -> dict[Path, str]:
    files = {root / "notes.txt": "mine", root / "results" / "run1.json": "{}", root / ".hidden": "x"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


@pytest.mark.slow
@pytest.mark.parametrize("demo", list(TINY))
def test_user_files_in_the_disk_path_survive_every_demo_and_reruns_work(
        demo: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if demo == "demo-remote":
        need_redis()
    root = tmp_path / "my-folder"
    files = _user_files(root)
    for _ in range(2):  # the rerun replaces the demo's own folder, and works
        rc = kvstrata.main([*TINY[demo], "--disk-path", str(root)])
        out = capsys.readouterr().out
        assert rc == 0, out
        assert " NO" not in out
    assert {p: p.read_text() for p in files} == files
    assert (root / demo / MARKER).is_file()
    assert sorted(p.name for p in root.iterdir()) == sorted([".hidden", "notes.txt", "results", demo])


@pytest.mark.slow
def test_demo_store_keep_reuses_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvstrata.main([*TINY["demo-store"], "--disk-path", str(tmp_path)]) == 0
    assert kvstrata.main([*TINY["demo-store"], "--disk-path", str(tmp_path), "--keep"]) == 0
    assert "retrieve after reopen" in capsys.readouterr().out
    assert (tmp_path / "demo-store" / "data.mdb").is_file()


def _refusals(tmp_path: Path) -> list[tuple[str, Path, Path]]:
    """(demo, --disk-path, a path that must survive) for each kind of folder kvstrata did not make."""
    cases = []
    users = tmp_path / "users-folder"  # a folder of the demo's name, made by the user
    (users / "demo-store").mkdir(parents=True)
    (users / "demo-store" / "data.mdb").write_text("the user's own LMDB")
    cases.append(("demo-store", users, users / "demo-store" / "data.mdb"))
    a_file = tmp_path / "file-named-demo"
    a_file.mkdir()
    (a_file / "demo").write_text("a file")
    cases.append(("demo", a_file, a_file / "demo"))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / MARKER).write_text("looks marked, but is behind a link")
    (target / "precious").write_text("x")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(target, linked / "demo-store")
    cases.append(("demo-store", linked, target / "precious"))
    return cases


def test_a_folder_kvstrata_did_not_make_is_refused_and_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for demo, disk_path, survivor in _refusals(tmp_path):
        before = survivor.read_text()
        rc = kvstrata.main([*TINY[demo], "--disk-path", str(disk_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, (demo, disk_path, err)
        assert len(err) == 1 and f"kvstrata {demo}: error:" in err[0] and str(disk_path / demo) in err[0], err
        assert MARKER in err[0]
        assert survivor.read_text() == before


@pytest.mark.slow
def test_default_folders_are_one_per_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert kvstrata.main(TINY["demo"]) == 0
    demo_db = tmp_path / "kvstrata_data" / "demo" / "data.mdb"
    stamp = demo_db.stat().st_mtime_ns, demo_db.read_bytes()
    assert kvstrata.main(TINY["demo-store"]) == 0  # must neither reuse nor wipe the main demo's folder
    capsys.readouterr()
    assert (demo_db.stat().st_mtime_ns, demo_db.read_bytes()) == stamp
    assert (tmp_path / "kvstrata_data" / "demo-store" / "data.mdb").is_file()


def test_prepare_reuses_or_replaces_only_a_marked_folder(tmp_path: Path) -> None:
    own = prepare(tmp_path / "new" / "parent", "demo-x", fresh=True)  # creates the parents
    assert own == tmp_path / "new" / "parent" / "demo-x" and (own / MARKER).is_file()
    (own / "data.mdb").write_text("old run")
    assert prepare(tmp_path / "new" / "parent", "demo-x", fresh=False) == own
    assert (own / "data.mdb").read_text() == "old run"
    prepare(tmp_path / "new" / "parent", "demo-x", fresh=True)
    assert not (own / "data.mdb").exists() and (own / MARKER).is_file()
    (own / MARKER).unlink()  # no marker: not kvstrata's any more, even for a reuse
    for fresh in (True, False):
        with pytest.raises(DemoDirError, match="demo-x"):
            prepare(tmp_path / "new" / "parent", "demo-x", fresh=fresh)
    assert own.is_dir()
