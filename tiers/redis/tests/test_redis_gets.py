"""`gets.py`, GET replies read straight off the socket, against a real redis-server:
values byte-identical to what was SET (RESP2 and RESP3, values split over many reads,
larger than the kept scratch buffer), misses, per-command errors that leave the
connection usable, push frames between replies, a frozen server, and the slower
public-parser path giving the same answers."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.connection import BlockingConnectionPool
from redis.exceptions import InvalidResponse, MovedError, OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tierkv_redis import gets
from tierkv_redis.gets import KEEP_SCRATCH, _error, pack_get, read_values
from tierkv_redis.sockets import SocketGuard
from tierkv_redis.testing import HandshakePeer, RedisServer


def _pool(server: RedisServer, **kwargs: object) -> BlockingConnectionPool:
    kwargs.setdefault("max_connections", 4)
    return BlockingConnectionPool.from_url(server.url, **kwargs)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as c:
        yield c


def _names(prefix: str, n: int) -> list[str]:
    return [f"gets-test:{prefix}:{os.urandom(6).hex()}:{i}" for i in range(n)]


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("in_turn", [False, True])  # one pipeline; each GET after the last reply
def test_values_read_back_byte_identical_with_misses_and_errors_in_place(
    redis_server: RedisServer, client: redis.Redis, protocol: int, direct: bool, in_turn: bool
) -> None:
    # sizes that fit one read, span many, and outgrow the scratch buffer mid-batch
    sizes = [0, 1, 5, 70_000, 1 << 20, 3 << 20, 17]
    names = _names("mix", len(sizes))
    values = [os.urandom(n) for n in sizes]
    for name, value in zip(names, values):
        client.set(name, value)
    wrong_type = _names("list", 1)[0]
    client.rpush(wrong_type, b"x")
    missing = _names("missing", 1)[0]
    asked = [*names[:3], missing, wrong_type, *names[3:]]
    pool = _pool(redis_server, protocol=protocol)
    try:
        commands = [pack_get(n.encode(), None) for n in asked]
        replies = read_values(pool, commands, direct=direct, in_turn=in_turn)
        assert [bytes(r) for r in replies[:3]] == values[:3]  # type: ignore[arg-type]
        assert replies[3] is None
        assert isinstance(replies[4], ResponseError) and "WRONGTYPE" in str(replies[4])
        assert [bytes(r) for r in replies[5:]] == values[3:]  # type: ignore[arg-type]
        # the connection went back to the pool clean: the next batch reads right
        last = [pack_get(names[-1].encode(), None)]
        again = read_values(pool, last, direct=direct, in_turn=in_turn)
        assert [bytes(r) for r in again] == [values[-1]]  # type: ignore[arg-type]
    finally:
        pool.disconnect()


def test_getex_renews_the_ttl(redis_server: RedisServer, client: redis.Redis) -> None:
    name = _names("ttl", 1)[0]
    client.set(name, b"v" * 100, px=5_000)
    pool = _pool(redis_server)
    try:
        (value,) = read_values(pool, [pack_get(name.encode(), 600_000)])
        assert bytes(value) == b"v" * 100  # type: ignore[arg-type]
        assert client.pttl(name) > 500_000
    finally:
        pool.disconnect()


def test_a_value_larger_than_the_kept_scratch_reads_whole(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    name = _names("big", 1)[0]
    value = os.urandom(KEEP_SCRATCH + 12_345)
    client.set(name, value)
    pool = _pool(redis_server)
    try:
        (got,) = read_values(pool, [pack_get(name.encode(), None)])
        assert bytes(got) == value  # type: ignore[arg-type]
        # read into a buffer of its own: the thread does not keep 32 MiB for later
        assert len(gets._scratch.values) <= KEEP_SCRATCH
    finally:
        pool.disconnect()


def test_values_read_by_many_threads_stay_each_threads_own(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    names = _names("threads", 32)
    values = {n: os.urandom(200_000 + i * 1_000) for i, n in enumerate(names)}
    for n, v in values.items():
        client.set(n, v)
    pool = _pool(redis_server)
    wrong: list[str] = []

    def reader(mine: list[str]) -> None:
        for _ in range(5):
            got = read_values(pool, [pack_get(n.encode(), None) for n in mine])
            wrong.extend(n for n, g in zip(mine, got) if bytes(g) != values[n])  # type: ignore[arg-type]

    threads = [threading.Thread(target=reader, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.disconnect()
    assert wrong == []


def test_a_push_frame_between_replies_is_read_past(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """RESP3 client tracking: a key this connection read is changed by another client,
    so the server pushes an invalidation before the next reply."""
    tracked, other = _names("push", 2)
    client.set(tracked, b"first")
    client.set(other, b"second" * 1000)
    pool = _pool(redis_server, protocol=3, max_connections=1)
    try:
        conn = pool.get_connection()
        conn.send_command("CLIENT", "TRACKING", "ON")
        assert conn.read_response() in (b"OK", "OK")
        pool.release(conn)
        (first,) = read_values(pool, [pack_get(tracked.encode(), None)])
        assert bytes(first) == b"first"  # type: ignore[arg-type]
        client.set(tracked, b"changed")  # -> an invalidation push on the pooled connection
        got = read_values(pool, [pack_get(other.encode(), None), pack_get(tracked.encode(), None)])
        assert [bytes(g) for g in got] == [b"second" * 1000, b"changed"]  # type: ignore[arg-type]
    finally:
        pool.disconnect()


def test_error_replies_keep_redis_pys_error_classes() -> None:
    """The tier tells OOM and MOVED (a stale slot map) from other refusals by class."""
    oom = _error(b"OOM command not allowed when used memory > 'maxmemory'.")
    assert isinstance(oom, OutOfMemoryError)
    moved = _error(b"MOVED 3999 127.0.0.1:6381")
    assert isinstance(moved, MovedError) and (moved.slot_id, moved.port) == (3999, 6381)
    assert type(_error(b"ERR something else")) is ResponseError


def test_a_frozen_server_raises_a_timeout_and_the_connection_is_dropped(
    start_redis: Callable[..., RedisServer],
) -> None:
    server = start_redis()
    with redis.Redis.from_url(server.url) as c:
        c.set("gets-test:frozen", b"v" * 10)
    pool = _pool(server, socket_timeout=0.3, max_connections=1)
    try:
        read_values(pool, [pack_get(b"gets-test:frozen", None)])  # one pooled connection
        server.freeze()
        with pytest.raises(RedisTimeoutError, match="Timeout reading from"):
            read_values(pool, [pack_get(b"gets-test:frozen", None)])
        server.thaw()
        # the connection with a reply unread was dropped: a fresh one reads the right value
        (value,) = read_values(pool, [pack_get(b"gets-test:frozen", None)])
        assert bytes(value) == b"v" * 10  # type: ignore[arg-type]
    finally:
        pool.disconnect()


def test_pack_get_is_what_redis_py_sends() -> None:
    conn = redis.connection.Connection()
    assert pack_get(b"k", None) == b"".join(conn.pack_command("GET", "k"))
    assert pack_get(b"k", 250) == b"".join(conn.pack_command("GETEX", "k", "PX", "250"))


def test_the_installed_redis_py_gives_the_socket_the_direct_path_reads(
    redis_server: RedisServer,
) -> None:
    """A canary: were a redis-py upgrade to move the socket, loads would still be right
    (through the parser) but twice as costly; this says so instead of a benchmark."""
    pool = _pool(redis_server)
    try:
        conn = pool.get_connection()
        try:
            assert isinstance(getattr(conn, "_sock", None), socket.socket)
        finally:
            pool.release(conn)
    finally:
        pool.disconnect()


@pytest.mark.parametrize("reply", [b"$x1\r\n", b"+OK\r\n", b"$5\r\nabcdefg\r\n"])
def test_a_reply_that_is_no_get_reply_raises_and_drops_the_connection(reply: bytes) -> None:
    """Something on the port that is not Redis (or a broken proxy): a clear
    InvalidResponse naming the address, never a value."""
    peer = HandshakePeer(b"\r\nGET\r\n", lambda conn, _: conn.sendall(reply))
    pool = BlockingConnectionPool.from_url(peer.url, protocol=2)
    try:
        with pytest.raises(InvalidResponse, match=f"127.0.0.1:{peer.port}"):
            read_values(pool, [pack_get(b"k", None)])
        peer.join(5)
    finally:
        pool.disconnect()
        peer.close()


def test_pooled_connections_a_restart_closed_are_reconnected(
    start_redis: Callable[..., RedisServer],
) -> None:
    """Every pooled connection of four threads points at a Redis that then restarts:
    the next reads succeed on reconnected connections, none fails."""
    server = start_redis()
    name = b"gets-test:restart"
    pool = _pool(server, max_connections=4)
    try:
        with redis.Redis.from_url(server.url) as c:
            c.set(name, b"before")
        barrier = threading.Barrier(4)
        seen: list[bytes] = []
        errors: list[BaseException] = []

        def reader() -> None:
            barrier.wait()  # four connections at once: the pool holds four
            try:
                (value,) = read_values(pool, [pack_get(name, None)])
                seen.append(bytes(value))  # type: ignore[arg-type]
            except BaseException as exc:  # collected: a thread's failure fails the test
                errors.append(exc)

        def read_in_four() -> None:
            threads = [threading.Thread(target=reader) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        read_in_four()
        assert seen == [b"before"] * 4 and not errors
        server.stop()
        server.start()  # same port, empty: persistence is off
        with redis.Redis.from_url(server.url) as c:
            c.set(name, b"after")
        seen.clear()
        read_in_four()
        assert errors == [] and seen == [b"after"] * 4
    finally:
        pool.disconnect()


class _CountingConnection(redis.Connection):
    """A connection that counts its sends (one per round trip the reader waits on)."""

    sends = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        type(self).sends += 1
        super().send_packed_command(command, check_health)  # type: ignore[arg-type]


def test_in_turn_a_small_expected_value_rides_with_the_command_before_it(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """A fitted block's small last part is asked with its large part: 3 blocks of
    (1 MiB, 100 B) parts are 3 sends, not 6; every value lands in its place; a value
    with no place (read through scratch) is never sent ahead."""
    names = _names("ahead", 6)
    values = [os.urandom(n) for n in (1 << 20, 100) * 3]
    for name, value in zip(names, values):
        client.set(name, value)
    slots = [bytearray(len(v)) for v in values]
    places = [gets.Place(lambda s=s: memoryview(s), 0, 0, len(s)) for s in slots]
    guard = SocketGuard()
    pool = _pool(redis_server, connection_class=_CountingConnection)
    try:
        commands = [pack_get(n.encode(), None) for n in names]
        read_values(pool, commands[:1], in_turn=True)  # connected: the handshake sends too
        _CountingConnection.sends = 0
        replies = read_values(pool, commands, places=places, guard=guard, in_turn=True)
        assert all(isinstance(r, gets.Placed) for r in replies)
        assert [bytes(s) for s in slots] == values
        assert _CountingConnection.sends == 3
        _CountingConnection.sends = 0  # no places: each in turn, as before
        again = read_values(pool, commands, in_turn=True)
        assert [bytes(r) for r in again] == values  # type: ignore[arg-type]
        assert _CountingConnection.sends == 6
    finally:
        guard.close()
        pool.disconnect()


def test_turns_end_at_a_large_value_a_value_with_no_place_or_the_ahead_limit() -> None:
    def place(n: int) -> gets.Place:
        return gets.Place(lambda: memoryview(b""), 0, 0, n)

    big, small = place(1 << 20), place(200)
    wanted = [big, small, small, big, small, None, small, big]
    assert gets._turn_end(wanted, 0) == 3
    assert gets._turn_end(wanted, 3) == 5  # stops before the value with no place
    assert gets._turn_end(wanted, 5) == 7
    assert gets._turn_end(wanted, 7) == 8
    many = [big] + [place(gets.AHEAD_BYTES // 4)] * 8
    assert gets._turn_end(many, 0) == 5  # AHEAD_BYTES of values ahead at most
