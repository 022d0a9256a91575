"""Every user mistake on the command line is one line naming the bad value and exit code 2
(never a traceback, never a run that reports failure without saying why), and each command's
--help is its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli import main as kvstrata
from cli.ports import free_port
from tests import ROOT
from tests.redis_fixtures import redis_server


def _absent_cuda() -> str:
    """A CUDA device this machine lacks."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    nobody = f"redis://127.0.0.1:{free_port()}"  # a port no server listens on
    cases = [
        (["demo-store", "--cpu-mib", "-1"], "-1"),
        (["demo-store", "--layers", "0"], "0"),
        (["demo-store", "--tokens", "0"], "0"),
        (["demo-store", "--disk-path", str(a_file)], "a-file"),
        (["demo", "--disk-path", str(a_file / "sub")], "a-file"),
        (["bench", "hashing", "--repeat", "0"], "0"),
        (["bench", "trace", "--trace", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["offload", "--lengths", "0"], "0"),
        (["offload", "--lengths", "999999"], "999999"),
        (["offload", "--lengths", "1024,x"], "'x'"),
        (["offload", "--questions", "1"], "1"),
        (["bench", "tiers", "--mib", "-3"], "-3"),
        (["bench", "tiers", "--sizes", "3K"], "3K"),
        (["bench", "scale", "--max-blocks", "-5"], "-5"),
        (["bench", "nosuch"], "nosuch"),
        (["nosuch"], "nosuch"),
        (["offload", "--device", _absent_cuda()], _absent_cuda()),
        (["offload", "--device", "foo"], "'foo'"),
        (["demo-remote", "--url", nobody, "--disk-path", str(tmp_path / "d")], nobody),
        (["demo-remote", "--url", "http://x", "--disk-path", str(tmp_path / "d")], "'http'"),
        (["demo-remote", "--url", "redis://127.0.0.1:99999"], "99999"),
        (["demo-remote", "--url", "redis://127.0.0.1:0"], "127.0.0.1:0"),
        (["bench", "remote", "--url", nobody], nobody),
        (["bench", "trace", "--fleet", "2", "--limit", "5", "--remote-url", nobody], nobody),
        (["bench", "trace", "--remote-url", "redis://:secret@127.0.0.1:1"], "--fleet"),
    ]
    traces = {"empty.jsonl": "", "not-json.jsonl": "{oops\n", "no-ids.jsonl": '{"x": 1}\n',
              "text-ids.jsonl": '{"hash_ids": ["a"]}\n', "not-gzip.jsonl.gz": "plain text"}
    for name, text in traces.items():
        (tmp_path / name).write_text(text)
        cases.append((["bench", "trace", "--trace", str(tmp_path / name)], name))
    cases += [
        (["demo-store", "--tokens", str(1 << 20), "--layers", "256", "--disk-path", str(tmp_path / "d")],
         f"--tokens {1 << 20}"),  # 1 TiB of KV: refused, not an out-of-memory kill
        (["demo-remote", "--tokens", str(1 << 20), "--disk-path", str(tmp_path / "d")], f"--tokens {1 << 20}"),
        (["bench", "vllm", "--cpu-bytes", "lots"], "'lots'"),
        (["bench", "vllm", "--out", str(tmp_path)], str(tmp_path)),
        (["bench", "vllm", "--model", str(tmp_path / "no-model")], "no-model"),
        (["bench", "vllm", "--doc-tokens", "9000"], "9000"),
    ]
    if importlib.util.find_spec("vllm") is None:
        cases += [(["bench", "vllm"], "vllm"), (["bench", "vllm-overhead"], "vllm")]
    return cases


def test_user_mistakes_get_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, bad in _cases(tmp_path):
        rc = kvstrata.main(argv)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == 2, (argv, rc, out, err)
        assert len(lines) == 1 and "error" in lines[0] and bad in lines[0], (argv, err)
        assert "Traceback" not in out + err
        assert "secret" not in err  # a password in a URL is never printed


def test_results_dir_that_is_a_file_is_refused_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "results.json"
    target.write_text("{}")
    monkeypatch.setenv("KVSTRATA_BENCH_RESULTS", str(target))
    assert kvstrata.main(["bench", "hashing", "--tokens", "64", "--repeat", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KVSTRATA_BENCH_RESULTS" in err[0] and "results.json" in err[0]


@pytest.mark.parametrize(("argv", "own_option"), [
    (["bench", "micro", "--help"], "--sizes"),
    (["bench", "trace", "--help"], "--fractions"),
    (["bench", "scale", "--help"], "--max-blocks"),
    (["offload", "--help"], "--lengths"),
    (["demo", "--help"], "--doc-tokens"),
])
def test_each_command_has_its_own_help(argv: list[str], own_option: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvstrata.main(argv) == 0
    out = capsys.readouterr().out
    assert own_option in out and f"kvstrata {' '.join(a for a in argv if a != '--help')}" in out


def test_every_command_and_benchmark_has_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [[c] for c in kvstrata.COMMANDS] + [["bench", b] for b in kvstrata.BENCHMARKS]
    for path in paths:
        assert kvstrata.main([*path, "--help"]) == 0, path
        out = capsys.readouterr().out
        assert f"Usage: kvstrata {' '.join(path)} [OPTIONS]" in out, (path, out[:200])
        assert "--help" in out


@pytest.mark.slow
def test_the_command_imports_a_benchmark_only_when_it_runs() -> None:
    """`cli` names the benchmarks by module string: the commands of its own (help included)
    leave `bench` unimported; `kvstrata bench hashing --help` imports exactly that module."""
    probe = ("import sys; from cli.main import main; main(sys.argv[1:]); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))")
    loaded = {}
    for args in (["--help"], ["demo", "--help"], ["inspect", "--help"], ["router", "--help"],
                 ["bench", "hashing", "--help"]):
        proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        loaded[" ".join(args)] = proc.stdout.strip().splitlines()[-1]
    assert loaded["bench hashing --help"] != "[]" and "'bench.hashing'" in loaded["bench hashing --help"]
    assert "'bench.trace'" not in loaded["bench hashing --help"]
    assert all(v == "[]" for k, v in loaded.items() if not k.startswith("bench")), loaded


@pytest.mark.slow
def test_shell_completion_offers_commands_and_benchmarks() -> None:
    import os
    import subprocess
    import sys

    def complete(words: str, cword: int) -> list[str]:
        env = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword), _KVSTRATA_COMPLETE="bash_complete")
        proc = subprocess.run([sys.executable, "-c", "from cli.main import main; main()"], env=env,
                              capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in proc.stdout.splitlines() if "," in line]

    assert {"demo", "router", "bench", "inspect"} <= set(complete("kvstrata ", 1))
    assert complete("kvstrata bench tr", 2) == ["transfer", "trace"]
    assert "--doc-tokens" in complete("kvstrata demo --doc", 2)


def test_demo_remote_without_redis_server_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "demo-remote", "--disk-path", str(tmp_path / "d")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("kvstrata demo-remote: error:") and "redis-server" in lines[0] and "--url" in lines[0]
    assert not (tmp_path / "d").exists()  # refused before anything was made


def test_demo_remote_names_a_bad_database_or_password(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with redis_server() as plain, redis_server("--requirepass", "s3cret") as locked:
        for url, bad in ((f"{plain.url}/99", "/99"), (f"{plain.url}/x", "'x'"), (locked.url, "password")):
            rc = kvstrata.main(["demo-remote", "--url", url, "--tokens", "64", "--disk-path", str(tmp_path / "d")])
            err = capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and len(err) == 1 and bad in err[0] and url.split("/")[2] in err[0], (url, err)


def test_each_no_in_the_demo_remote_table_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with redis_server("--maxmemory", "1mb", "--maxmemory-policy", "noeviction") as full:  # every write fails
        rc = kvstrata.main(["demo-remote", "--url", full.url, "--tokens", "256", "--disk-path", str(tmp_path / "d")])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("host ")]
    assert rc == 1 and len(rows) == 3, out
    for row in rows:
        assert " NO: " in row, row
        reason = row.split(" NO: ", 1)[1]
        assert "writes dropped on host A" in reason or "server errors on host A" in reason, row
    assert "0 of 256 tokens found" in rows[1]


def test_offload_help_names_one_default_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvstrata.main(["offload", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "cuda when present, else cpu" in text and "default: cpu]" not in text and "default: cuda]" not in text


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write to any directory")
def test_a_disk_path_that_cannot_be_written_is_refused_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert kvstrata.main(["demo-store", "--tokens", "64", "--disk-path", str(locked / "sub")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "locked" in err[0] and "writable" in err[0], err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)
