"""Loopback `mooncake_master` processes for the tests, skipped where Mooncake is not installed.

A master with its HTTP metadata server on free loopback ports (`--enable_http_metadata_server`);
its clients (the tiers) use the TCP transport. Without the `mooncake` extra (the store client
and its `mooncake_master`) the tests skip, except under `KVSTRATA_TEST_REQUIRE_MOONCAKE=1` (CI),
where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cli.ports import free_port
from tests.switches import switches

STARTUP_S = 20.0


def need_mooncake() -> str:
    """The `mooncake_master` binary's path, with the store client importable; skips the test
    (fails under KVSTRATA_TEST_REQUIRE_MOONCAKE=1) otherwise."""
    why = ""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        why = f"the Mooncake store client is not installed ({exc})"
    path = shutil.which("mooncake_master") or shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    if not why and path is None:
        why = "no mooncake_master binary"
    if why:
        if switches().require_mooncake:
            pytest.fail(f"KVSTRATA_TEST_REQUIRE_MOONCAKE=1 but {why}")
        pytest.skip(why)
    assert path is not None
    return path


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class MooncakeMaster:
    """A master on loopback: `master` (host:port) and `metadata_server` (URL) for a tier's config."""

    def __init__(self, binary: str) -> None:
        self._binary = binary
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.master = f"127.0.0.1:{self.port}"
        self.metadata_server = f"http://127.0.0.1:{self.http_port}/metadata"
        self._proc: subprocess.Popen[bytes] | None = None

    def tier(self, **fields: Any) -> dict[str, Any]:
        """A tier config (as a dict) on this master: small buffers, quick faults."""
        return {"type": "mooncake", "master": self.master, "metadata_server": self.metadata_server,
                "local_hostname": "127.0.0.1", "segment_bytes": 64 << 20, "buffer_bytes": 4 << 20,
                "timeout_s": 2.0, "cooldown_s": 0.5, "setup_timeout_s": 5.0, **fields}

    def start(self) -> None:
        """Start the master (on the same ports as before) and wait until it listens."""
        self._proc = subprocess.Popen(
            [self._binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             f"--http_metadata_server_port={self.http_port}", "--http_metadata_server_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1", "--enable_metric_reporting=false",
             "--default_kv_lease_ttl=1000", "--client_ttl=10"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "GLOG_minloglevel": "2"})
        end = time.monotonic() + STARTUP_S
        while not (_listening(self.port) and _listening(self.http_port)):
            if self._proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"mooncake_master did not start on {self.master}")
            time.sleep(0.05)

    def pause(self) -> None:
        """Stop the master (SIGSTOP): its connections stay open and nothing answers, as a hung host."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused master run on (SIGCONT)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kill the master at once (SIGKILL), as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(10)
        self._proc = None


@contextmanager
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A started loopback master, killed afterwards."""
    master = MooncakeMaster(need_mooncake())
    master.start()
    try:
        yield master
    finally:
        from tiers.mooncake.client import close_idle

        close_idle()  # while the master runs: a client closed after it died waits for it for seconds
        master.kill()
