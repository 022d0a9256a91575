"""Correctness issue, item 14: every user mistake on the command line is one line naming the
bad value and exit code 2 (tracebacks and exit 0 before), and each command's --help is its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import cli


def _cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [
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
    ]


def test_user_mistakes_get_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, bad in _cases(tmp_path):
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == 2, (argv, rc, out, err)
        assert len(lines) == 1 and "error" in lines[0] and bad in lines[0], (argv, err)
        assert "Traceback" not in out + err


def test_results_dir_that_is_a_file_is_refused_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "results.json"
    target.write_text("{}")
    monkeypatch.setenv("KVSTRATA_RESULTS", str(target))
    assert cli.main(["bench", "hashing", "--tokens", "64", "--repeat", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KVSTRATA_RESULTS" in err[0] and "results.json" in err[0]


@pytest.mark.parametrize(("argv", "own_option"), [
    (["bench", "micro", "--help"], "--sizes"),
    (["bench", "trace", "--help"], "--fractions"),
    (["bench", "scale", "--help"], "--max-blocks"),
    (["offload", "--help"], "--lengths"),
    (["demo", "--help"], "--doc-tokens"),
])
def test_each_command_has_its_own_help(argv: list[str], own_option: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert own_option in out and f"kvstrata {' '.join(a for a in argv if a != '--help')}" in out


def test_every_command_and_benchmark_has_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [[c] for c in cli.COMMANDS] + [["bench", b] for b in cli.BENCHMARKS]
    for path in paths:
        assert cli.main([*path, "--help"]) == 0, path
        out = capsys.readouterr().out
        assert f"Usage: kvstrata {' '.join(path)} [OPTIONS]" in out, (path, out[:200])
        assert "--help" in out


def test_shell_completion_offers_commands_and_benchmarks() -> None:
    import os
    import subprocess
    import sys

    def complete(words: str, cword: int) -> list[str]:
        env = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword), _KVSTRATA_COMPLETE="bash_complete")
        proc = subprocess.run([sys.executable, "-c", "from bench.cli import main; main()"], env=env,
                              capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in proc.stdout.splitlines() if "," in line]

    assert {"demo", "router", "bench", "inspect"} <= set(complete("kvstrata ", 1))
    assert complete("kvstrata bench tr", 2) == ["transfer", "trace"]
    assert "--doc-tokens" in complete("kvstrata demo --doc", 2)
