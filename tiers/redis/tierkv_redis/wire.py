"""SETs whose value is a frame, written from a worker thread with one copy of the block,
or none.

Through redis-py's command API a framed SET copies the block twice: once to put the
header in front of it, and again when the packed command's pieces are joined. Here a
command's pieces (`set_pieces`: its RESP framing, the header, the block's buffers) are
either joined once into one exact `bytes`, sent as it is (`send_sets`, pipelined or in
turn), or, for MiB-sized blocks sent in turn, written straight from the slot under the
job's `SocketGuard` (`send_straight`; `sendall` releases the GIL while it writes). The
pool's `get_connection`/`release` and the connection's `send_packed_command`/
`read_response` are redis-py's; `send_straight` writes to the connection's socket.

Every node's blocking client sends stores this way: a single server's, and each cluster
node's (the tier routes a cluster's commands itself, `cluster.py`).
"""

from __future__ import annotations

import contextlib
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierkv.contract.framing import Payload, payload_length
from tierkv.tier import detached
from tierkv_redis.gets import AHEAD_BYTES
from tierkv_redis.sockets import SlotsClosed, SocketGuard, connected_socket

Pieces = tuple["bytes | bytearray | memoryview", ...]
"""One command's bytes in order, not joined (the payload's pieces are views of a slot)."""


def set_pieces(name: bytes, header: bytes, payload: Payload, px: int | None) -> Pieces:
    """`SET name <header + payload> [PX px]` as pieces: its RESP framing, `header` and
    the payload's buffers themselves (no copy)."""
    argc = 3 if px is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        argc,
        len(name),
        name,
        len(header) + payload_length(payload),
    )
    if px is None:
        tail = b"\r\n"
    else:
        ms = str(px).encode()
        tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
    if isinstance(payload, tuple):
        return (head, header, *payload, tail)
    return (head, header, payload, tail)


def _reply(conn: Any) -> ResponseError | None:
    try:
        conn.read_response()
        return None
    except ResponseError as exc:  # this command failed; the connection is fine
        return detached(exc)


def _send_once(
    pool: ConnectionPool, commands: Sequence[bytes], in_turn: bool
) -> list[ResponseError | None]:
    conn: Any = pool.get_connection()
    try:
        outcomes: list[ResponseError | None] = []
        if in_turn:  # each command once the last one's reply is in (a small one: the next's)
            unread = 0
            for command in commands:
                conn.send_packed_command([command], check_health=False)
                unread += 1
                if len(command) > AHEAD_BYTES:
                    outcomes.extend(_reply(conn) for _ in range(unread))
                    unread = 0
            outcomes.extend(_reply(conn) for _ in range(unread))
            return outcomes
        for command in commands:  # one exact bytes each: written without a join
            conn.send_packed_command([command], check_health=False)
        for _ in commands:
            try:
                conn.read_response()
                outcomes.append(None)
            except ResponseError as exc:  # this command failed; the connection is fine
                outcomes.append(detached(exc))
        return outcomes
    except BaseException:
        # a connection with replies still unread must never go back to the pool
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def send_straight(
    pool: ConnectionPool,
    blocks: Sequence[Callable[[], list[Pieces]]],
    guard: SocketGuard,
) -> list[ResponseError | None] | None:
    """Worker thread: SET blocks straight from their slots, one command at a time (a
    small one, a fitted block's last part, goes with the next: `gets.AHEAD_BYTES`).

    `blocks[i]()` gives the commands of block i as pieces (views of its slot, made for
    this call: they are released after it); it is called, and its pieces sent, only
    while the job lives, with the socket registered with the job's `guard`
    (`SocketGuard.moving`), which cuts it if the job ends meanwhile: no view of a slot
    outlives the job, and no byte of a slot is read after it.

    Returns per command None (stored) or the server's error, in order; None when the
    connection's socket cannot be reached (then nothing was sent: the caller packs the
    commands instead). Connection errors raise after one retry on a fresh connection,
    as `send_sets`."""
    try:
        return _straight_once(pool, blocks, guard)
    except ConnectionError:
        return _straight_once(pool, blocks, guard)


def _straight_once(
    pool: ConnectionPool, blocks: Sequence[Callable[[], list[Pieces]]], guard: SocketGuard
) -> list[ResponseError | None] | None:
    conn: Any = pool.get_connection()
    try:
        sock = connected_socket(conn)
        if sock is None:
            return None
        where = f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
        outcomes: list[ResponseError | None] = []
        unread = 0  # small commands sent whose replies are read after the next one
        for make in blocks:
            with guard.moving(sock) as alive:
                if not alive:
                    raise SlotsClosed("the job ended before this block was sent")
                commands = make()
                try:
                    for pieces in commands:
                        _send_pieces(sock, pieces, where)
                        unread += 1
                        if _length(pieces) > AHEAD_BYTES:
                            outcomes.extend(_reply(conn) for _ in range(unread))
                            unread = 0
                finally:
                    _release(commands)  # no view of a slot outlives the guard
        outcomes.extend(_reply(conn) for _ in range(unread))
        return outcomes
    except BaseException as exc:
        # no finished frame of the failure may keep a view of a slot alive
        traceback.clear_frames(exc.__traceback__)
        # a connection with replies still unread must never go back to the pool
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _length(pieces: Pieces) -> int:
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in pieces)


def _release(commands: list[Pieces]) -> None:
    """Release every view in `commands`: whatever still refers to them (a traceback's
    frame) no longer holds the slot's buffer. `blocks[i]()` must make views of its
    own for this (`memoryview(view)`), never hand out a view someone else keeps."""
    for pieces in commands:
        for piece in pieces:
            if isinstance(piece, memoryview):
                with contextlib.suppress(BufferError):  # in use elsewhere: a bug, not ours
                    piece.release()


def _send_pieces(sock: socket.socket, pieces: Pieces, where: str) -> None:
    """Write `pieces` in order (redis-py's timeout mode: each `sendall` bounded by the
    socket's timeout); errors as redis-py's."""
    try:
        for piece in pieces:
            sock.sendall(piece)
    except TimeoutError as exc:
        raise RedisTimeoutError(f"Timeout writing to {where}") from exc
    except OSError as exc:
        raise ConnectionError(f"Error while writing to {where}: {exc}") from exc


def send_sets(
    pool: ConnectionPool, commands: Sequence[bytes], *, in_turn: bool = False
) -> list[ResponseError | None]:
    """Worker thread: send packed SETs down one pooled connection, pipelined (or
    `in_turn`: each once the reply to the last is read); return per command None
    (stored) or the server's error. Connection errors raise, after one retry on a
    fresh connection (a pooled connection a Redis restart closed fails once); a
    timeout raises at once (a frozen server would only be waited on twice)."""
    try:
        return _send_once(pool, commands, in_turn)
    except ConnectionError:
        return _send_once(pool, commands, in_turn)
