"""kvstrata as a user gets it: a wheel built from the repo, installed, run from outside the repo.

The project is copied, built into a wheel (no build isolation: no network) and installed with
pip into a scratch folder (no dependencies: this Python has them). Everything then runs in an
interpreter started with `-S`, so no `.pth` file of this environment is read and the editable
install of the checkout (a `.pth` import hook) cannot supply a module the wheel lacks; the
dependencies come from this environment's site-packages on `PYTHONPATH`. pytest is made
unimportable, so shipped code that imports a test-only package fails here too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from cli.redis_servers import find_redis_binary
from tests import ROOT

# The top-level packages the wheel installs (import-linter's root packages: the layers).
PACKAGES = sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])
# Modules that import an optional extra absent from the dev environment (vLLM: `.venv-vllm`).
OPTIONAL = {"vllm"}


@dataclass(frozen=True)
class Installed:
    """A wheel installed into `site`, and how to run Python on it alone."""

    wheel: Path
    site: Path
    env: dict[str, str]

    def python(self, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run `python -S ARGS` on the installed wheel (no editable install, no pytest)."""
        return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A wheel of the checkout, built and installed into a scratch folder."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs pip and setuptools in this Python to build the project")
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"  # a copy, so the build leaves nothing in the checkout
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                    "--wheel-dir", str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("kvstrata-*.whl")
    target = tmp / "site"
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    hidden = tmp / "hidden"  # first on the path: `import pytest` fails as if it were not installed
    (hidden / "pytest").mkdir(parents=True)
    (hidden / "pytest" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pytest'\")\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVSTRATA_"))}
    path = [str(hidden), str(target), *site.getsitepackages()]
    env.update(PYTHONPATH=os.pathsep.join(path), KVSTRATA_BENCH_RESULTS=str(tmp / "results"))
    return Installed(wheel, target, env)


def _checkout_modules() -> set[str]:
    """Every module of the six packages in the checkout, as a dotted name."""
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if all((ROOT.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
                names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_wheel_holds_every_module_of_the_checkout(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        shipped = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in wheel.namelist() if n.endswith(".py")}
    missing = _checkout_modules() - shipped
    assert not missing, f"the wheel lacks {sorted(missing)}"


def test_every_module_imports_from_the_wheel_alone(installed: Installed, tmp_path: Path) -> None:
    probe = """
import importlib, json, sys
out = {"editable": [type(f).__name__ for f in sys.meta_path if "editable" in type(f).__name__.lower()],
       "failed": {}, "outside": []}
for name in json.loads(sys.argv[1]):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        out["failed"][name] = e.name or repr(e)
    except Exception as e:
        out["failed"][name] = repr(e)
    else:
        if not module.__file__.startswith(sys.argv[2]):
            out["outside"].append(module.__file__)
print(json.dumps(out))
"""
    modules = sorted(_checkout_modules())
    done = installed.python("-c", probe, json.dumps(modules), str(installed.site), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["editable"] == [] and result["outside"] == [], result
    failed = {name: why for name, why in result["failed"].items() if why.split(".")[0] not in OPTIONAL}
    assert not failed, failed
    assert len(modules) > 100  # the probe imported the whole library, not an empty list


def test_the_installed_copy_is_the_one_that_runs(installed: Installed, tmp_path: Path) -> None:
    probe = installed.python("-c", "import cli, bench, pytest", cwd=tmp_path)
    assert "No module named 'pytest'" in probe.stderr
    for package in ("cli", "bench"):  # the command's package and the benchmarks it dispatches to
        where = installed.python("-c", f"import {package}; print({package}.__file__)", cwd=tmp_path)
        assert where.stdout.strip().startswith(str(installed.site)), where


def _run(installed: Installed, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed `kvstrata` script, run by the clean interpreter."""
    return installed.python(str(installed.site / "bin" / "kvstrata"), *args, cwd=cwd)


@pytest.mark.slow
def test_remote_commands_run_without_pytest(installed: Installed, tmp_path: Path) -> None:
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
