"""GETs whose values are read off the socket straight into their slots (or a reused buffer).

Through redis-py a GET of a MiB-sized value costs three copies and a fresh allocation
beyond the kernel's: the socket is read in chunks that are fed to the hiredis reader,
which joins them in a growing buffer, then makes a new `bytes` of the value, whose pages
the kernel must fault in and zero. Measured on the 2-core dev machine, loads of 1 MiB
blocks were bound by the client's CPU (1.7-2.1 s per GiB, the server 0.5 s) and ran at
half the speed of the same GETs read this way.

Here a worker thread sends a batch's GETs (or GETEXs) down one pooled connection and
reads each bulk reply with `recv_into`, the header line through a small buffer. With
the job's `SocketGuard` and a `Place` per command, a value of the frame's length goes
header to scratch and payload straight into its slot, each in one call on a socket in
blocking mode (`sockets.whole_io`), while the job lives: the guard cuts the socket
when the job ends, so a thread the deadline left behind never writes a slot after it.
Any other value (another length, no place, a job already ended, a TLS socket read in
pieces) goes into the thread's scratch buffer, kept for the next batch, and the caller
checks it there and copies its payload into the slot.

It takes the connection from redis-py's blocking pool (connect, AUTH, SELECT, TLS and
READONLY stay redis-py's) and reads its socket, which redis-py keeps in a private
attribute; a connection without one is read through redis-py's public `read_response`
instead, with the same results. RESP2 and RESP3 replies are both understood; a RESP3
push frame (a notification) between replies is read past.
"""

from __future__ import annotations

import socket
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError, InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierkv.tier import detached
from tierkv_redis.sockets import SocketGuard, connected_socket, recv_whole, usable, whole_io

try:  # the parser's table of error codes -> ResponseError subclasses (MOVED, OOM, ...)
    from redis._parsers.base import BaseParser as _Parser
except ImportError:  # pragma: no cover - another redis-py layout
    _Parser = None  # type: ignore[assignment,misc]


@dataclass(frozen=True, slots=True)
class Place:
    """Where a value of `head + (end - start)` bytes goes: its first `head` bytes to
    the thread's scratch, the rest straight into `view()[start:end]` (a slot's bytes;
    `view` is called only while the job lives, and its view dropped before the job's
    `SocketGuard` can close)."""

    view: Callable[[], memoryview]
    head: int
    start: int
    end: int


class Placed:
    """A value read into its `Place`: `head` is its first bytes (a view of the
    scratch buffer), the rest is in the slot, unchecked."""

    __slots__ = ("head",)

    def __init__(self, head: memoryview) -> None:
        self.head = head


# One reply of a GET: the value (a view of the thread's scratch buffer, valid until the
# thread reads its next batch), Placed (the value read into its slot), None for a
# missing key, or the server's error.
Reply: TypeAlias = memoryview | bytes | Placed | ResponseError | None

_LINE_BUFFER = 64 * 1024
AHEAD_BYTES = 64 * 1024
"""In turn, commands whose replies are expected to be this long together at most (a
fitted block's small last part) are sent with the command before them: no round trip
of their own, and never more than one large value in flight on the connection."""
# A thread keeps a scratch buffer up to this size for its next batch; a batch needing
# more gets one of its own, freed with it.
KEEP_SCRATCH = 32 << 20


def pack_get(name: bytes, px: int | None) -> bytes:
    """The RESP bytes of `GET name`, or `GETEX name PX px` (a read that renews the ttl)."""
    if px is None:
        return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)
    ms = str(px).encode()
    return b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%s\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (
        len(name),
        name,
        len(ms),
        ms,
    )


def _error(text: bytes) -> ResponseError:
    message = text.decode("utf-8", "replace")
    if _Parser is not None:
        exc = _Parser.parse_error(message)  # type: ignore[no-untyped-call]
        if isinstance(exc, ResponseError):
            return exc
    return ResponseError(message)


class _Scratch(threading.local):
    """Per worker thread: the buffer values are read into, and the line buffer."""

    def __init__(self) -> None:
        self.values = bytearray(0)
        self.line = bytearray(_LINE_BUFFER)


_scratch = _Scratch()


class _SocketReplies:
    """Reads the replies of GETs from one socket: header lines through the thread's line
    buffer, values straight into a scratch buffer with `recv_into`."""

    def __init__(
        self,
        sock: socket.socket,
        where: str,
        *,
        whole: bool = False,
        timeout: float | None = None,
        guard: SocketGuard | None = None,
    ) -> None:
        self.sock = sock
        self.where = where
        self.guard = guard  # values with a Place are read into their slot under it
        # in `whole_io` mode (blocking): each value read in one call, within `timeout`
        self.whole = whole
        self.timeout = timeout
        self.line = memoryview(_scratch.line)
        self.pos = 0
        self.end = 0
        self.values = _scratch.values
        self.used = 0  # bytes of `values` holding this batch's replies

    def _recv(self, into: memoryview) -> int:
        try:
            n = self.sock.recv_into(into)
        except (TimeoutError, BlockingIOError) as exc:  # a frozen server (either mode)
            raise RedisTimeoutError(f"Timeout reading from {self.where}") from exc
        except OSError as exc:
            raise ConnectionError(f"Error while reading from {self.where}: {exc}") from exc
        if n == 0:
            raise ConnectionError(f"Connection closed by server ({self.where}).")
        return n

    def _header(self) -> bytes:
        """The next reply's first line, without its CRLF."""
        while True:
            at = _scratch.line.find(b"\r\n", self.pos, self.end)
            if at >= 0:
                text = bytes(self.line[self.pos : at])
                self.pos = at + 2
                return text
            if self.pos:  # keep the partial line at the front
                rest = self.end - self.pos
                self.line[:rest] = self.line[self.pos : self.end]
                self.pos, self.end = 0, rest
            if self.end == len(self.line):
                raise InvalidResponse(f"a reply line over {len(self.line)} bytes from {self.where}")
            self.end += self._recv(self.line[self.end :])

    def _room(self, n: int) -> memoryview:
        """`n` bytes of scratch after this batch's earlier values. A buffer too small is
        replaced, not resized: views of the earlier values keep the old one alive."""
        if self.used + n > len(self.values):
            self.values = bytearray(max(n, 2 * len(self.values)))
            self.used = 0
            if len(self.values) <= KEEP_SCRATCH:
                _scratch.values = self.values
        view = memoryview(self.values)[self.used : self.used + n]
        self.used += n
        return view

    def _count(self, head: bytes) -> int:
        """The length or count a reply's first line gives after its type byte."""
        try:
            return int(head[1:])
        except ValueError:
            raise InvalidResponse(f"a bad reply line {head[:40]!r} from {self.where}") from None

    def _skip(self, head: bytes) -> None:
        """Read past the rest of a reply whose first line is `head` (any RESP type)."""
        kind = head[:1]
        if kind in b"$=!":  # blob string, verbatim string, blob error
            length = self._count(head)
            if length >= 0:
                self._body(memoryview(bytearray(length + 2)))  # small, and dropped
        elif kind in b"*>~":  # array, push, set
            for _ in range(max(self._count(head), 0)):
                self._skip(self._header())
        elif kind == b"%" or kind == b"|":  # map, attribute: key and value per entry
            for _ in range(2 * self._count(head)):
                self._skip(self._header())
        # any other type is one line, already read

    def _placed(self, length: int, place: Place, guard: SocketGuard) -> Reply:
        """Read a value of `length` bytes: its head into scratch, the rest into its
        slot while the job lives (`Placed`); when the job has ended, all of it into
        scratch (a value, as if it had no place: never a half-read `Placed`)."""
        head = self._room(place.head + 2)  # the head, then the CRLF
        self._body(head[: place.head])
        with guard.moving(self.sock) as alive:
            if alive:
                dest = place.view()[place.start : place.end]
                try:
                    self._body(dest)
                except BaseException as exc:
                    # no frame of the failed read may keep a view of the slot alive
                    # (a slab is unmapped only once every view of it is gone)
                    traceback.clear_frames(exc.__traceback__)
                    raise
                finally:
                    dest.release()
        if alive:
            self._body(head[place.head :])
            self._crlf(head[place.head :])
            return Placed(head[: place.head])
        body = self._room(length + 2)
        body[: place.head] = head[: place.head]
        self._body(body[place.head :])
        self._crlf(body[length:])
        return body[:length]

    def _crlf(self, end: memoryview) -> None:
        if bytes(end) != b"\r\n":
            raise InvalidResponse(f"a value from {self.where} does not end with CRLF")

    def _body(self, body: memoryview) -> None:
        """Fill `body` from the line buffer's rest, then from the socket."""
        have = min(self.end - self.pos, len(body))
        body[:have] = self.line[self.pos : self.pos + have]
        self.pos += have
        if self.whole and have < len(body):
            recv_whole(self.sock, body[have:], self.where, self.timeout)
            return
        while have < len(body):
            have += self._recv(body[have:])

    def next(self, place: Place | None = None) -> Reply:
        """The next reply: a value, None (no such key) or the server's error. A value
        of the length `place` expects is read into its slot while the job lives
        (`Placed`); any other value into scratch."""
        head = self._header()
        kind = head[:1]
        if kind == b"$":
            length = self._count(head)
            if length < 0:
                return None
            if (
                place is not None
                and self.guard is not None
                and length == place.head + place.end - place.start
            ):
                return self._placed(length, place, self.guard)
            body = self._room(length + 2)
            self._body(body)
            self._crlf(body[length:])
            return body[:length]
        if kind == b"-":
            return _error(head[1:])
        if kind == b"_":  # RESP3 null
            return None
        if kind == b">":  # RESP3 push (a notification the server may send any time)
            self._skip(head)
            return self.next()
        raise InvalidResponse(f"unexpected reply {head[:40]!r} to a GET from {self.where}")


def _read_on(
    conn: Any,
    commands: Sequence[bytes],
    direct: bool,
    places: Sequence[Place | None] | None,
    guard: SocketGuard | None,
    in_turn: bool,
) -> list[Reply]:
    """Send `commands` down `conn` (connecting it if it is not) and read their replies
    (into their places where the socket can be read whole); `in_turn`: each command
    sent once the reply to the last one is read."""
    if in_turn:
        return _read_in_turn(conn, commands, direct, places, guard)
    conn.send_packed_command([b"".join(commands)], check_health=False)
    sock = getattr(conn, "_sock", None)
    if direct and isinstance(sock, socket.socket):
        where = f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
        if not usable(sock):  # TLS, or not Linux: in pieces, in redis-py's mode
            replies = _SocketReplies(sock, where)
            return [replies.next() for _ in commands]
        timeout = sock.gettimeout()
        with whole_io(sock, timeout):
            replies = _SocketReplies(sock, where, whole=True, timeout=timeout, guard=guard)
            if places is None:
                return [replies.next() for _ in commands]
            return [replies.next(place) for place in places]
    return _public_replies(conn, commands, send_each=False)


def _read_in_turn(
    conn: Any,
    commands: Sequence[bytes],
    direct: bool,
    places: Sequence[Place | None] | None,
    guard: SocketGuard | None,
) -> list[Reply]:
    """`_read_on` with each command sent once the last one's reply is read; a command
    whose place expects a small value (AHEAD_BYTES) goes with the one before it."""
    sock = connected_socket(conn)
    if not direct or sock is None:
        return _public_replies(conn, commands, send_each=True)
    where = f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
    wanted = places if places is not None else [None] * len(commands)
    out: list[Reply] = []
    if not usable(sock):  # TLS, or not Linux: in pieces, in redis-py's mode
        replies = _SocketReplies(sock, where)
        for command in commands:
            conn.send_packed_command([command], check_health=False)
            out.append(replies.next())
        return out
    timeout = sock.gettimeout()
    with whole_io(sock, timeout):
        # a GET sent here cannot block: the server has read every command before it
        # (it answered them), so the socket's send buffer is empty
        replies = _SocketReplies(sock, where, whole=True, timeout=timeout, guard=guard)
        sent = 0
        for i, place in enumerate(wanted):
            if i == sent:
                sent = _turn_end(wanted, i)
                conn.send_packed_command(list(commands[i:sent]), check_health=False)
            out.append(replies.next(place))
    return out


def _turn_end(wanted: Sequence[Place | None], first: int) -> int:
    """The end of the commands sent together from `first`: it and the following ones
    whose places expect small values, AHEAD_BYTES of them at most (their commands
    are a few dozen bytes each: the send cannot fill the socket's buffer)."""
    end, ahead = first + 1, 0
    while end < len(wanted):
        place = wanted[end]
        if place is None:
            break
        ahead += place.head + place.end - place.start
        if ahead > AHEAD_BYTES:
            break
        end += 1
    return end


def _public_replies(conn: Any, commands: Sequence[bytes], *, send_each: bool) -> list[Reply]:
    """The replies to `commands` through redis-py's parser (the public, slower way),
    each command sent first when `send_each`."""
    out: list[Reply] = []
    for command in commands:
        if send_each:
            conn.send_packed_command([command], check_health=False)
        try:
            out.append(conn.read_response())
        except ResponseError as exc:
            out.append(detached(exc))
    return out


def read_values(
    pool: ConnectionPool,
    commands: Sequence[bytes],
    *,
    direct: bool = True,
    places: Sequence[Place | None] | None = None,
    guard: SocketGuard | None = None,
    in_turn: bool = False,
) -> list[Reply]:
    """Worker thread: send packed GETs (`pack_get`) down one pooled connection, as one
    pipeline (or `in_turn`: each once the reply to the last is read), and read their
    replies: per command the value, None, or the server's error. A value is a view
    of this thread's scratch buffer, valid until the thread's next call. Connection
    errors raise, after one retry on a fresh connection (a pooled connection a Redis
    restart closed fails once); a timeout raises at once. `direct=False` reads through
    redis-py's parser, as on a connection whose socket cannot be reached.

    With `places` (one per command, or None) and the job's `guard`, a value of the
    length its place expects is read straight into its slot (`Placed`) where the
    socket can be read whole; the job ending meanwhile cuts the connection
    (`SlotsClosed`, not retried)."""
    conn: Any = pool.get_connection()
    try:
        try:
            return _read_on(conn, commands, direct, places, guard, in_turn)
        except ConnectionError:
            # as redis-py retries: the same connection, reconnected (another pooled one
            # could be just as stale)
            conn.disconnect()
            return _read_on(conn, commands, direct, places, guard, in_turn)
    except BaseException:
        # a connection with replies still unread must never go back to the pool
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
