"""The router on a background thread, for demos, benchmarks and tests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from router.config import RouterConfig
from router.service import Router, _run


class RouterThread:
    """`Router` serving on `host:port` (0: a free port) on its own thread; `stop()` ends it.
    Raises what starting raised (`ConfigError` if the address cannot be bound)."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.router = Router(config)
        self._host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner: Any = None
        self._thread = threading.Thread(target=self._main, name="kvstrata-router", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = self._loop.run_until_complete(_run(self.router, self._host, self.port))
            self.port = self._runner.addresses[0][1]
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the router's loop and return its result (state is the loop's)."""
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
