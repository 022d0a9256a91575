"""The soak's router: `kvstrata router` following engine 0's KV events, killed and restarted at
random, and at the end held to what engine 0 itself reports holding.

Engine 0 has tiers of its own (CPU and a private disk, no shared tier: a server's evictions
are announced by no one), so once its events have arrived the router's `matched_tokens` for
it must equal the store's own `lookup` of every prompt.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import child_env
from cli.ports import free_port

INSTANCE = "engine-0"


class RouterWatch:
    """One `kvstrata router` process subscribed to engine 0's publisher on `events_port`."""

    def __init__(self, workdir: Path, events_port: int) -> None:
        self.port = free_port()
        self.events_port = events_port
        self.log = workdir / "router.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start the router (again); its state comes back from the publisher's welcome."""
        endpoints = f"tcp://127.0.0.1:{self.events_port},tcp://127.0.0.1:{self.events_port + 1}"
        env = child_env()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "router", "--port", str(self.port),
                                          "--subscribe", f"{INSTANCE}={endpoints}"], env=env,
                                         stdout=log, stderr=log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def matched(self, tokens: list[int], salt: str) -> int | None:
        """The router's matched tokens for engine 0, or None if it does not answer now."""
        body = json.dumps({"token_ids": tokens, "cache_salt": salt}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/lookup", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as reply:
                answer = json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return int(answer.get("instances", {}).get(INSTANCE, {}).get("matched_tokens", 0))

    def converge(self, expected: dict[str, tuple[list[int], str, int]], timeout_s: float) -> dict[str, list[int]]:
        """Ask until the router agrees with engine 0 on every prompt (`expected`: name -> tokens,
        salt, tokens held), or `timeout_s`; the prompts it still disagrees on, (router, store)."""
        deadline = time.monotonic() + timeout_s
        off: dict[str, list[int]] = {}
        while True:
            off = {}
            for name, (tokens, salt, held) in expected.items():
                got = self.matched(tokens, salt)
                if got != held:
                    off[name] = [-1 if got is None else got, held]
            if not off or time.monotonic() > deadline:
                return off
            time.sleep(0.5)

    def stop(self) -> None:
        self.kill()
