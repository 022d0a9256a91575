"""RESP (the Redis protocol, versions 2 and 3) on a connected socket, for large values.

Commands are packed as lists of buffers: the values themselves are never copied into a
command; `send_all` hands the whole list to the kernel with `sendmsg` (scatter-gather), one
system call for many commands. `RespReader` parses replies from its own 64 KiB buffer, and
reads a bulk reply's value with `recv_into` straight into a buffer the caller chooses (one
copy, by the kernel), so a value is never assembled piecewise or copied again in Python; a
value's last bytes may land in memory of their own (`bulk_into`'s `tail`: a block's tensor),
the rest in the chosen buffer.

Nothing a server claims is trusted: every reply is read against the most its command can
return (the caller's `limit`, in bytes on the wire). A longer claim (a bulk length, an
aggregate's count, nesting deeper than `_MAX_DEPTH`) is a `ReplyTooLong` before anything is
allocated or read for it: the connection is out of step and must be closed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

_SMALL = 4096  # arguments shorter than this are copied into the command's header bytes
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_SCATTER = 8  # views per recvmsg_into (a receive fills a few: more would be converted for nothing)
_READ_SIZE = 1 << 16  # the reader's own buffer
_SPARE = 4096  # of it, received into with a value's last views (more: payload bytes copied out of it later)
SMALL_REPLY = 64  # the bound of a reply that is a status, an integer or a short string
_PUSH_BYTES = 1 << 16  # the bound of a RESP3 push message skipped before a reply
_MAX_DEPTH = 8  # aggregates nested deeper are a protocol error
_MIN_ITEM = 3  # the shortest element of an aggregate on the wire ("_\r\n")
Buffer = bytes | bytearray | memoryview


class Socket(Protocol):
    """What the reader and `send_all` need of a connected socket."""

    def recv_into(self, buffer: Any, nbytes: int = 0, /) -> int: ...
    def recvmsg_into(self, buffers: Any, /) -> tuple[int, list[Any], int, Any]: ...
    def sendall(self, data: Any, /) -> None: ...
    def sendmsg(self, buffers: Any, /) -> int: ...


class ProtocolError(ConnectionError):
    """The server sent something that is not the RESP reply expected: the connection's
    state is unknown and it must be closed."""


class ReplyTooLong(ProtocolError):
    """A reply claiming more than its command can return (`claimed` bytes or elements over
    `limit`): refused before anything was allocated or read for it."""

    def __init__(self, what: str, claimed: int, limit: int) -> None:
        super().__init__(f"{what} of {claimed} claimed, more than the {limit} bytes this reply may hold")
        self.claimed, self.limit = claimed, limit


class ReplyError(Exception):
    """An error reply (`-ERR ...`, `-OOM ...`, `-MOVED ...`): the command failed, the
    connection is fine."""

    @property
    def is_redirect(self) -> bool:
        """A cluster node answering for a slot it does not serve (MOVED or ASK)."""
        return str(self).startswith(("MOVED ", "ASK "))


class Oversized(int):
    """In place of a bulk value longer than the caller accepts: its length. The value was
    read and dropped, so the connection stays usable."""


class Landed(NamedTuple):
    """A bulk value received in parts: its first bytes in `head` (a buffer the reader's
    caller chose), the rest in the views of `tail` (as given to `bulk_into`), in order."""

    head: memoryview
    tail: Sequence[memoryview]


def command(*args: Buffer | str | int) -> list[Buffer]:
    """The RESP array of `args` as buffers to send in order; arguments of at least 4 KiB
    are referenced, not copied."""
    out: list[Buffer] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        data: Buffer = b"%d" % arg if isinstance(arg, int) else arg.encode() if isinstance(arg, str) else arg
        size = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        if size < _SMALL:
            head.append(b"$%d\r\n%s\r\n" % (size, data))
        else:
            head.append(b"$%d\r\n" % size)
            out += (b"".join(head), data)
            head = [b"\r\n"]
    out.append(b"".join(head))
    return out


def send_all(sock: Socket, buffers: Sequence[Buffer], *, gather: bool = True) -> None:
    """Send `buffers` in order, whole: with `sendmsg` (many buffers a call) when `gather`,
    else one `sendall` each (a TLS socket cannot gather)."""
    if not gather:
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        i = _consume(views, i, sock.sendmsg(views[i : i + _IOV_MAX]))
        while i < len(views) and not views[i].nbytes:
            i += 1


def _consume(views: list[memoryview], i: int, n: int) -> int:
    """Mark the next `n` bytes of `views` from `views[i]` on done, in order (a system call
    moved them): views wholly done are passed over, one partly done is cut to its rest.
    Returns the index of the first view not wholly done."""
    while n:
        size = views[i].nbytes
        if n < size:
            views[i] = views[i][n:]
            return i
        n -= size
        i += 1
    return i


class RespReader:
    """Replies from one connection, in order. Keeps bytes read past a reply for the next;
    `idle` says whether it holds none (a connection may go back to a pool only then)."""

    def __init__(self, sock: Socket) -> None:
        self._sock = sock
        self._scatter = bool(getattr(sock, "gathers", True))  # recvmsg_into works (not on TLS)
        self._buf = bytearray(_READ_SIZE)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    @property
    def idle(self) -> bool:
        return self._start == self._end

    def _fill(self) -> None:
        """Read more bytes after those held (moving them to the front when needed)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise ProtocolError(f"a reply line longer than {_READ_SIZE} bytes")
            held = self._end - self._start
            self._view[:held] = self._view[self._start : self._end]
            self._start, self._end = 0, held
        n = self._sock.recv_into(self._view[self._end :])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        self._end += n

    def _line(self) -> bytes:
        while True:
            j = self._buf.find(b"\r\n", self._start, self._end)
            if j >= 0:
                line = bytes(self._view[self._start : j])
                self._start = j + 2
                return line
            self._fill()

    def _exact(self, dst: memoryview) -> None:
        """Fill `dst` with the next bytes of the stream: first those held, then straight
        from the socket (through the own buffer only for short tails)."""
        held = min(self._end - self._start, dst.nbytes)
        dst[:held] = self._view[self._start : self._start + held]
        self._start += held
        pos = held
        while pos < dst.nbytes:
            if dst.nbytes - pos < _READ_SIZE // 2:
                self._fill()
                take = min(self._end - self._start, dst.nbytes - pos)
                dst[pos : pos + take] = self._view[self._start : self._start + take]
                self._start += take
                pos += take
                continue
            n = self._sock.recv_into(dst[pos:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            pos += n

    def _exact_all(self, views: Sequence[memoryview]) -> None:
        """`_exact` of each of `views` in turn, with one `recvmsg_into` (the kernel scattering
        into many views) per system call where the socket allows."""
        if not self._scatter:
            for view in views:
                self._exact(view)
            return
        pending = [v.cast("B") for v in views if v.nbytes]
        i = 0
        while i < len(pending) and self._start < self._end:  # the bytes held first
            take = min(self._end - self._start, pending[i].nbytes)
            pending[i][:take] = self._view[self._start : self._start + take]
            self._start += take
            pending[i] = pending[i][take:]
            i += not pending[i].nbytes
        if self._start == self._end:
            self._start = self._end = 0
        while i < len(pending):  # the own buffer is empty here (every held byte was taken)
            batch = pending[i : i + _SCATTER]
            last = i + _SCATTER >= len(pending)
            if last:  # what follows the value (its CRLF, the next reply's head) comes in the same call
                batch.append(self._view[self._end : self._end + _SPARE])
            n = self._sock.recvmsg_into(batch)[0]
            if n == 0:
                raise ConnectionError("the server closed the connection")
            spill = n - sum(v.nbytes for v in pending[i:]) if last else 0
            if spill > 0:  # every view is full; the rest went into the own buffer
                self._end += spill
                n -= spill
            i = _consume(pending, i, n)

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("a bulk reply not ended by CRLF")
        self._start += 2

    def _skip(self, size: int) -> None:
        scratch = memoryview(bytearray(min(size, 1 << 20)))
        while size:
            take = min(size, scratch.nbytes)
            self._exact(scratch[:take])
            size -= take

    def reply(self, limit: int = SMALL_REPLY) -> Any:
        """The next reply, RESP3 push messages skipped: bytes (a simple or bulk string),
        int, float, bool, None, a list (arrays, sets and maps flattened), or a `ReplyError`
        (returned, not raised). `ReplyTooLong` if it claims more than `limit` bytes on the
        wire (a push message: `_PUSH_BYTES`)."""
        while True:
            line = self._line()
            push = line[:1] == b">"
            value = self._parse(line, [_PUSH_BYTES if push else limit], 0)
            if not push:
                return value

    def _parse(self, line: bytes, budget: list[int], depth: int) -> Any:
        """The reply that `line` begins, charged against `budget[0]` (the bytes it may still
        take on the wire)."""
        kind, rest = line[:1], line[1:]
        budget[0] -= len(line) + 2
        if budget[0] < 0:
            raise ReplyTooLong("a reply line", len(line) + 2, budget[0] + len(line) + 2)
        try:
            if kind == b"+":
                return rest
            if kind == b"-":
                return ReplyError(rest.decode(errors="replace"))
            if kind in (b":", b"("):
                return int(rest)
            if kind in (b"$", b"=", b"!"):
                size = int(rest)
                if size < 0:
                    return None
                if size + 2 > budget[0]:
                    raise ReplyTooLong("a bulk string", size, budget[0])
                budget[0] -= size + 2
                data = bytearray(size)
                self._exact(memoryview(data))
                self._crlf()
                return ReplyError(data.decode(errors="replace")) if kind == b"!" else bytes(data)
            if kind == b"_":
                return None
            if kind == b"#":
                return rest == b"t"
            if kind == b",":
                return float(rest)
            if kind in (b"*", b"~", b">", b"%", b"|"):
                count = int(rest) * (2 if kind in (b"%", b"|") else 1)
                if count * _MIN_ITEM > budget[0]:
                    raise ReplyTooLong("an aggregate", count, budget[0])
                if depth >= _MAX_DEPTH:
                    raise ReplyTooLong("nesting", depth + 1, _MAX_DEPTH)
                items = [self._parse(self._line(), budget, depth + 1) for _ in range(max(count, 0))]
                return None if count < 0 else items
        except ValueError:
            pass
        raise ProtocolError(f"not a RESP reply: {line[:40]!r}")

    def bulk_into(self, buffer_for: Callable[[int], memoryview | None], limit: int,
                  tail: Sequence[memoryview] | None = None) -> memoryview | Landed | Oversized | ReplyError | None:
        """The next reply, a bulk string of at most `limit` bytes, read into
        `buffer_for(length)` (a view of exactly that many bytes; None: longer than wanted, read
        and dropped, `Oversized` returned). With `tail` (writable views of T bytes in all) a
        value longer than T is split: its last T bytes are received straight into the views,
        in order, the rest into `buffer_for(length - T)`, and a `Landed` is returned (a
        shorter value leaves `tail` untouched). None for a null reply; a `ReplyError` for an error;
        `ReplyTooLong` for a longer claim (nothing read for it); `ProtocolError` for
        anything else."""
        while True:
            line = self._line()
            kind = line[:1]
            if kind == b">":  # a push message before the reply: parse it whole and skip it
                self._parse(line, [_PUSH_BYTES], 0)
                continue
            break
        if kind == b"$":
            try:
                size = int(line[1:])
            except ValueError:
                raise ProtocolError(f"bad bulk length: {line[:40]!r}") from None
            if size < 0:
                return None
            if size > limit:
                raise ReplyTooLong("a bulk string", size, limit)
            landed = 0 if tail is None else sum(view.nbytes for view in tail)
            into = tail if tail is not None and size > landed else None
            dst = buffer_for(size if into is None else size - landed)
            if dst is None:
                self._skip(size)
                self._crlf()
                return Oversized(size)
            if into is None:
                self._exact(dst)
            else:
                self._exact_all([dst, *into])
            self._crlf()
            return dst if into is None else Landed(dst, into)
        if kind == b"_":
            return None
        if kind == b"-":
            return ReplyError(line[1:].decode(errors="replace"))
        raise ProtocolError(f"expected a bulk string, got {line[:40]!r}")
