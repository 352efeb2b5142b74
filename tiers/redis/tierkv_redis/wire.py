"""SETs whose value is a frame, written with one copy of the block, from a worker thread.

Through redis-py's command API a framed SET copies the block twice: once to put the
header in front of it, and again when the packed command's pieces are joined. Here the
header and the block are assembled straight into the finished RESP command, one exact
`bytes`, which goes to the socket as it is (`sendall` releases the GIL while it
writes). It uses only public redis-py calls: the blocking pool's
`get_connection`/`release` and the connection's `send_packed_command`/`read_response`.

Every node's blocking client sends stores this way: a single server's, and each cluster
node's (the tier routes a cluster's commands itself, `cluster.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError, ResponseError

from tierkv.contract.framing import Payload, payload_length
from tierkv.tier import detached


def pack_set(name: bytes, header: bytes, payload: Payload, px: int | None) -> bytes:
    """The RESP bytes of `SET name <header + payload> [PX px]` (`payload` one buffer or
    regions, copied once, into the command)."""
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
        return b"".join((head, header, *payload, tail))
    return b"".join((head, header, payload, tail))


def _send_once(pool: ConnectionPool, commands: Sequence[bytes]) -> list[ResponseError | None]:
    conn = pool.get_connection()
    try:
        for command in commands:  # one exact bytes each: written without a join
            conn.send_packed_command([command], check_health=False)  # type: ignore[no-untyped-call]
        outcomes: list[ResponseError | None] = []
        for _ in commands:
            try:
                conn.read_response()
                outcomes.append(None)
            except ResponseError as exc:  # this command failed; the connection is fine
                outcomes.append(detached(exc))
        return outcomes
    except BaseException:
        # a connection with replies still unread must never go back to the pool
        conn.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(conn)


def send_sets(pool: ConnectionPool, commands: Sequence[bytes]) -> list[ResponseError | None]:
    """Worker thread: send packed SETs down one pooled connection, pipelined; return
    per command None (stored) or the server's error. Connection errors raise, after
    one retry on a fresh connection (a pooled connection a Redis restart closed fails
    once); a timeout raises at once (a frozen server would only be waited on twice)."""
    try:
        return _send_once(pool, commands)
    except ConnectionError:
        return _send_once(pool, commands)
