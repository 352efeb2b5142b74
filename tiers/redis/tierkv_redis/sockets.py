"""A pooled connection's socket in blocking mode with kernel timeouts, for one batch.

redis-py keeps its sockets in timeout mode: the descriptor is non-blocking and each
`recv` or `send` first polls, so a 1 MiB value arrives in 10-20 pieces of whatever the
socket buffer held, each a system call that drops and retakes the GIL. With 16 worker
threads on 2 cores every retake waits on the others: loads of 1 MiB blocks ran at half
the speed of the same reads made whole (measured: raw sockets, 16 threads, one 1 MiB
GET each, 0.51 GB/s in pieces, 1.11 GB/s whole).

`whole_io(sock, timeout)` puts the socket in blocking mode for one batch's reads, with
the same `timeout` enforced by the kernel (`SO_RCVTIMEO`), and restores redis-py's mode
after. Then `recv_into(view, 0, MSG_WAITALL)` reads a whole value in one call, the GIL
released once. A kernel timeout ends a call with what it had (a partial count) or
`BlockingIOError` (nothing): `recv_whole` turns both into redis-py's `TimeoutError`, so
a frozen server fails a batch within `timeout` as before. Stores keep redis-py's sends:
SETs sent whole the same way stored 1 MiB blocks 10-20 % slower in three interleaved
pairs of `tierkv bench`.

Only a plain TCP or Unix socket of Linux qualifies (`usable`); a TLS socket refuses
flags on `recv_into`, and elsewhere the timeval layout differs: those keep redis-py's
mode and read in pieces.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from redis.exceptions import ConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierkv.tier import SlotGuard

_LINUX = sys.platform.startswith("linux")
WAITALL = getattr(socket, "MSG_WAITALL", 0)


def usable(sock: object) -> bool:
    """Whether `sock` can be read and written whole (a plain socket on Linux)."""
    return _LINUX and WAITALL != 0 and type(sock) is socket.socket


def connected_socket(conn: Any) -> socket.socket | None:
    """The socket of redis-py connection `conn`, connected first if it is not (connect,
    AUTH, SELECT and TLS stay redis-py's); None where redis-py keeps no plain socket
    where this reads it (a private attribute: a later redis-py may move it)."""
    if getattr(conn, "_sock", None) is None:
        conn.connect()
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


@contextlib.contextmanager
def whole_io(sock: socket.socket, timeout: float | None) -> Iterator[None]:
    """`sock` blocking, each read bounded by `timeout` in the kernel, for the block's
    duration; redis-py's timeout mode restored after (also on an error). Nothing may
    be sent meanwhile (sends would block without a bound)."""
    before = sock.gettimeout()
    limit = _timeval(timeout if timeout is not None and timeout > 0 else 0.0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.settimeout(None)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # a socket closed meanwhile: nothing to restore
            sock.settimeout(before)


def recv_whole(sock: socket.socket, into: memoryview, where: str, timeout: float | None) -> None:
    """Fill `into` from `sock` (blocking, `whole_io`), in one call unless a signal
    cuts it short (then the rest is read); a call the kernel's `timeout` ended raises
    redis-py's `TimeoutError`."""
    have = 0
    size = len(into)
    ends = None if timeout is None else time.monotonic() + timeout
    while have < size:
        try:
            n = sock.recv_into(into[have:], 0, WAITALL)
        except BlockingIOError as exc:  # SO_RCVTIMEO ran out with nothing read
            raise RedisTimeoutError(f"Timeout reading from {where}") from exc
        except TimeoutError as exc:
            raise RedisTimeoutError(f"Timeout reading from {where}") from exc
        except OSError as exc:
            raise ConnectionError(f"Error while reading from {where}: {exc}") from exc
        if n == 0:
            raise ConnectionError(f"Connection closed by server ({where}).")
        have += n
        if have < size and ends is not None and time.monotonic() >= ends:
            # cut short by the timeout mid-value (a signal cuts it sooner)
            raise RedisTimeoutError(f"Timeout reading from {where}")


class SlotsClosed(Exception):
    """A job's slots closed while this thread moved bytes between one of them and a
    socket (`SocketGuard.moving`): the job has ended, the connection is cut."""


class SocketGuard(SlotGuard):
    """A job's `SlotGuard` that also lets worker threads move bytes between a socket
    and the job's slots (a value read straight into its slot, a block sent straight
    from it) without holding the job's lock across the network.

    `moving(sock)` registers the socket while its thread reads into or writes from a
    slot; any number of threads move at once. `close()` (the job ended, on time or
    not) marks the guard closed, shuts every registered socket down, which ends its
    blocked `recv_into` or `sendmsg` at once, waits for those threads to let go (a
    system call's return and a few Python lines), then closes the `SlotGuard`. After
    `close()` returns no thread of the job touches a slot, as with the plain guard;
    what the cut connections had in flight is lost with them (a half-sent SET is
    never executed; a half-read value is a failed key of a job already answered)."""

    def __init__(self) -> None:
        super().__init__()
        self._moving: dict[int, socket.socket] = {}
        self._changed = threading.Condition(threading.Lock())
        self._closed = False

    @contextlib.contextmanager
    def moving(self, sock: socket.socket) -> Iterator[bool]:
        """True while the job lives: then `sock` may carry bytes into or out of the
        job's slots until the block ends, and `close()` cuts it if the job ends
        meanwhile (the block then raises `SlotsClosed`). False: the job has ended."""
        token = id(sock)
        with self._changed:
            alive = not self._closed and token not in self._moving
            if alive:
                self._moving[token] = sock
        if not alive:
            yield False
            return
        try:
            yield True
        except Exception as exc:
            if self._closed:
                raise SlotsClosed("the job ended while its bytes were moving") from exc
            raise
        finally:
            with self._changed:
                del self._moving[token]
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            for sock in self._moving.values():
                with contextlib.suppress(OSError):  # already closed or reset
                    sock.shutdown(socket.SHUT_RDWR)
            while self._moving:
                self._changed.wait()
        super().close()
