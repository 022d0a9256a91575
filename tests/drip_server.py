"""A hostile RESP server on loopback for the remote tier's tests: it answers like Redis but
drips the replies to chosen commands one byte at a time, each byte well within a socket
timeout, so only a bound on a call's total time ends the call.

It speaks just enough RESP3 for redis-py and the tier: arrays of bulk strings in; out, a map
for HELLO and CONFIG GET, `:1` for EXISTS, a long bulk string for GET, `+OK` for the rest;
commands on a namespace's generation key are never dripped (GET answers `GENERATION`).
It counts connections opened and closed by the client (EOF or a reset while dripping).
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

GENERATION = b"0123456789abcdef"


def on_generation(command: list[bytes]) -> bool:
    """Whether `command` reads or sets a namespace's generation (`tiers/remote/keys.py`)."""
    return len(command) >= 2 and command[1].endswith(b":gen2")


class DripServer:
    """Drips the replies to the commands in `drip` (upper case) every `interval_s`."""

    def __init__(self, drip: set[str], interval_s: float = 0.05, reply_bytes: int = 1 << 20) -> None:
        self.drip = drip
        self.interval_s = interval_s
        self.reply_bytes = reply_bytes
        self.num_opened = self.num_closed = 0
        self.commands: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.num_opened += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _reply(self, command: list[bytes]) -> bytes:
        name = command[0].decode().upper() if command else ""
        if name == "HELLO":  # redis-py 8 speaks RESP3: a map naming the protocol
            return b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n"
        if name == "CONFIG":
            return b"%1\r\n$16\r\nmaxmemory-policy\r\n$11\r\nallkeys-lru\r\n"
        if on_generation(command) and name == "GET":
            return b"$%d\r\n%s\r\n" % (len(GENERATION), GENERATION)
        if name == "EXISTS":
            return b":1\r\n"
        if name == "GET":
            return b"$%d\r\n" % self.reply_bytes + b"x" * self.reply_bytes + b"\r\n"
        return b"+OK\r\n"

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                command = _read_command(reader)
                if command is None:
                    break
                name = command[0].decode().upper()
                self.commands.append(name)
                if not self._answer(conn, name, command):
                    return
        except OSError:  # the client gave up and closed the connection
            pass
        finally:
            with self._lock:
                self.num_closed += 1
            conn.close()

    def _answer(self, conn: socket.socket, name: str, command: list[bytes]) -> bool:
        """Send the reply to `command` (named `name`), dripped if its name is in `drip`; False
        once the server is stopping."""
        reply = self._reply(command)
        if name not in self.drip or on_generation(command):
            conn.sendall(reply)
            return True
        for i in range(len(reply)):
            if self._stop.is_set():
                return False
            conn.sendall(reply[i : i + 1])
            time.sleep(self.interval_s)
        return True

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> DripServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _read_command(reader: object) -> list[bytes] | None:
    """One RESP array of bulk strings; None at EOF."""
    line = reader.readline()  # type: ignore[attr-defined]
    if not line:
        return None
    if not line.startswith(b"*"):
        return [line.strip()]  # an inline command
    args = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])  # type: ignore[attr-defined]
        args.append(reader.read(size + 2)[:-2])  # type: ignore[attr-defined]
    return args
