"""SETs whose value is a frame, written with one copy of the block instead of two.

Through redis-py's command API a framed SET copies the block twice: once to put the
header in front of it, and again when the stream joins the packed command's pieces
before writing (Python 3.11's transport `writelines` joins). Here the header and the
block are assembled straight into the finished RESP command, one exact `bytes`, which
goes to the socket as it is. It uses only public redis-py calls: the pool's
`get_connection`/`release` and the connection's `send_packed_command`/`read_response`.

Single-node clients only; a cluster client takes the ordinary path.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio.connection import ConnectionPool
from redis.exceptions import ConnectionError, ResponseError


def pack_set(name: bytes, header: bytes, payload: bytes | memoryview, px: int | None) -> bytes:
    """The RESP bytes of `SET name <header + payload> [PX px]`."""
    argc = 3 if px is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        argc,
        len(name),
        name,
        len(header) + len(payload),
    )
    if px is None:
        tail = b"\r\n"
    else:
        ms = str(px).encode()
        tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
    return b"".join((head, header, payload, tail))


async def _send_once(pool: ConnectionPool, commands: Sequence[bytes]) -> list[ResponseError | None]:
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        for command in commands:  # one exact bytes each: written without a join
            await conn.send_packed_command(command)
        outcomes: list[ResponseError | None] = []
        for _ in commands:
            try:
                await conn.read_response()
                outcomes.append(None)
            except ResponseError as exc:  # this command failed; the connection is fine
                outcomes.append(exc)
        return outcomes
    except BaseException:
        # a connection with replies still unread must never go back to the pool;
        # nowait: closed before any await, so a cancellation cannot skip it
        await conn.disconnect(nowait=True)
        raise
    finally:
        await pool.release(conn)


async def send_sets(pool: ConnectionPool, commands: Sequence[bytes]) -> list[ResponseError | None]:
    """Send packed SETs down one pooled connection, pipelined; return per command
    None (stored) or the server's error. Connection errors raise, after one retry on
    a fresh connection (a pooled connection a Redis restart closed fails once)."""
    try:
        return await _send_once(pool, commands)
    except ConnectionError:
        return await _send_once(pool, commands)
