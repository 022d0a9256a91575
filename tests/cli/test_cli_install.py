"""The `kvstrata` command as a user gets it: a non-editable install, run from outside the repo.

The project is installed with pip into a scratch folder (no dependencies: this Python has
them), and its `kvstrata` script runs from another directory with pytest made unimportable,
so shipped code that imports a test-only package, or that works only from a checkout, fails
here. The commands are the ones that use `cli/redis_servers.py`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from cli.redis_servers import find_redis_binary
from tests import ROOT

# The top-level packages the wheel installs, as pyproject.toml lists them.
_LISTED = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
PACKAGES = sorted({p.split(".")[0] for p in _LISTED})


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(the installed `kvstrata` script, the environment to run it in)."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs pip and setuptools in this Python to build the project")
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"  # a copy, so the build leaves nothing in the checkout
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-compile", "--disable-pip-version-check", "--target", str(site), str(src)],
                   check=True, capture_output=True, timeout=300)
    hidden = tmp / "hidden"  # first on the path: `import pytest` fails as if it were not installed
    (hidden / "pytest").mkdir(parents=True)
    (hidden / "pytest" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pytest'\")\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVSTRATA_"))}
    env.update(PYTHONPATH=f"{hidden}{os.pathsep}{site}", KVSTRATA_BENCH_RESULTS=str(tmp / "results"))
    return site / "bin" / "kvstrata", env


def _run(installed: tuple[Path, dict[str, str]], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script, env = installed
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_copy_is_the_one_that_runs(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    script, env = installed
    probe = subprocess.run([sys.executable, "-c", "import cli, bench, pytest"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert "No module named 'pytest'" in probe.stderr
    for package in ("cli", "bench"):  # the command's package and the benchmarks it dispatches to
        where = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__file__)"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=120)
        assert where.stdout.strip().startswith(str(script.parent.parent)), where


@pytest.mark.slow
def test_remote_commands_run_without_pytest(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    helped = _run(installed, tmp_path, "bench", "remote", "--help")
    assert helped.returncode == 0 and "Usage: kvstrata bench remote" in helped.stdout, helped.stderr[-2000:]
    runs = [("demo-remote", "--tokens", "64", "--disk-path", str(tmp_path / "data")),
            ("bench", "trace", "--fleet", "2", "--limit", "40", "--fractions", "1/4")]
    for args in runs:
        done = _run(installed, tmp_path, *args)
        assert "Traceback" not in done.stderr, (args, done.stderr[-3000:])
        if find_redis_binary() is not None:
            assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
        else:  # no server to start: one line saying so
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and "redis-server" in lines[0], (args, done.stderr)
