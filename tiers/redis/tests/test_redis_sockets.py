"""`sockets.py` and the loads that read values straight into their slots: whole reads
and writes in blocking mode with kernel timeouts, redis-py's timeout mode restored
after each batch, a job's `SocketGuard` cutting a read into a slot when the job ends
(nothing reaches the slot afterwards), stores sent straight from their slots cut the
same way (no view of the slot left), and byte-identical round trips through the tier
at the block sizes the README quotes, split blocks included."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any, ClassVar

import pytest
import redis
from redis.connection import BlockingConnectionPool
from redis.exceptions import TimeoutError as RedisTimeoutError
from tierkv_redis import RedisTier, RedisTierConfig, wire
from tierkv_redis.gets import Place, Placed, _SocketReplies, pack_get, read_values
from tierkv_redis.names import ALLOC_SLACK, FIT_MAX_TAIL, size_class
from tierkv_redis.sockets import SlotsClosed, SocketGuard, recv_whole, usable, whole_io
from tierkv_redis.testing import HandshakePeer, RedisServer
from tierkv_redis.wire import Pieces, send_sets, send_straight, set_pieces

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryTier
from tierkv.testing import fill_slots, random_keys

MiB = 1 << 20


def test_whole_io_blocks_for_the_batch_and_restores_redis_pys_mode() -> None:
    a, b = socket.socketpair()
    try:
        a.settimeout(1.5)
        assert usable(a)
        with whole_io(a, 1.5):
            assert a.gettimeout() is None  # blocking: one call per value
            sender = threading.Thread(target=b.sendall, args=(b"x" * 300_000,))
            sender.start()  # more than the socket buffers hold: read while it is sent
            into = memoryview(bytearray(300_000))
            recv_whole(a, into, "pair", 1.5)
            sender.join(5)
            assert bytes(into) == b"x" * 300_000
        assert a.gettimeout() == 1.5
    finally:
        a.close()
        b.close()


def test_a_whole_read_from_a_silent_peer_times_out_in_the_kernels_time() -> None:
    a, b = socket.socketpair()
    try:
        b.sendall(b"y" * 10)  # part of the value, then silence
        started = time.monotonic()
        with whole_io(a, 0.3), pytest.raises(RedisTimeoutError, match="Timeout reading"):
            recv_whole(a, memoryview(bytearray(100)), "pair", 0.3)
        assert 0.25 < time.monotonic() - started < 2.0
    finally:
        a.close()
        b.close()


def test_tls_sockets_are_not_read_whole() -> None:
    import ssl

    context = ssl.create_default_context()
    sock = context.wrap_socket(
        socket.socket(), server_hostname="localhost", do_handshake_on_connect=False
    )
    try:
        assert not usable(sock)  # recv_into refuses flags on TLS sockets
    finally:
        sock.close()


def _placed_read(
    payload: int, sent: int, guard: SocketGuard, slot: memoryview
) -> tuple[socket.socket, threading.Thread, list[BaseException | object]]:
    """A thread reading one GET reply of a `payload`-byte value (8-byte head), placed
    to go into all of `slot`, of which the peer has sent `sent` payload bytes so far."""
    a, b = socket.socketpair()
    b.sendall(b"$%d\r\n" % (8 + payload) + b"H" * 8 + b"p" * sent)
    out: list[BaseException | object] = []

    def read() -> None:
        with whole_io(a, 5.0):
            replies = _SocketReplies(a, "pair", whole=True, timeout=5.0, guard=guard)
            try:
                out.append(replies.next(Place(lambda: slot, 8, 0, len(slot))))
            except BaseException as exc:
                out.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    return b, thread, out


def test_a_job_ending_mid_read_cuts_it_and_never_writes_the_slot_after() -> None:
    slot = memoryview(bytearray(b"\xee" * MiB))
    guard = SocketGuard()
    peer, thread, out = _placed_read(MiB, 100_000, guard, slot)
    try:
        deadline = time.monotonic() + 5
        while slot[99_999] != ord("p") and time.monotonic() < deadline:
            time.sleep(0.01)  # the first bytes reached the slot; the rest is awaited
        started = time.monotonic()
        guard.close()  # the job's deadline: returns once the read let go
        assert time.monotonic() - started < 1.0
        thread.join(5)
        assert not thread.is_alive()
        assert len(out) == 1 and isinstance(out[0], SlotsClosed)
        with pytest.raises(OSError):  # the connection was cut: nothing more arrives
            peer.sendall(b"p" * MiB)
            peer.sendall(b"p" * MiB)
        time.sleep(0.05)
        assert bytes(slot[100_000:]) == b"\xee" * (MiB - 100_000)
        with guard.hold() as alive:
            assert not alive
    finally:
        peer.close()


def test_a_job_that_ended_before_the_read_gets_the_value_in_scratch() -> None:
    slot = memoryview(bytearray(b"\xee" * 1000))
    guard = SocketGuard()
    guard.close()
    peer, thread, out = _placed_read(1000, 1000, guard, slot)
    try:
        peer.sendall(b"\r\n")
        thread.join(5)
        assert len(out) == 1 and isinstance(out[0], memoryview)  # not Placed
        assert bytes(out[0]) == b"H" * 8 + b"p" * 1000
        assert bytes(slot) == b"\xee" * 1000
    finally:
        peer.close()


def test_a_value_of_another_length_never_reaches_the_slot() -> None:
    slot = memoryview(bytearray(b"\xee" * 1000))
    guard = SocketGuard()
    peer, thread, out = _placed_read(999, 999, guard, slot)  # the place expects 1000
    try:
        peer.sendall(b"\r\n")
        thread.join(5)
        assert len(out) == 1 and isinstance(out[0], memoryview)
        assert bytes(slot) == b"\xee" * 1000
    finally:
        peer.close()
        guard.close()


def test_placed_values_and_misses_in_one_batch(redis_server: RedisServer) -> None:
    with redis.Redis.from_url(redis_server.url) as c:
        c.set("sockets-test:a", b"HEAD" + b"a" * 5000)
        c.set("sockets-test:b", b"HEAD" + b"b" * 4999)  # not the expected length
    slots = [memoryview(bytearray(5000)) for _ in range(3)]
    places = [Place(lambda s=s: s, 4, 0, 5000) for s in slots]
    pool = BlockingConnectionPool.from_url(redis_server.url, max_connections=1, socket_timeout=2)
    guard = SocketGuard()
    try:
        names = [b"sockets-test:a", b"sockets-test:missing", b"sockets-test:b"]
        replies = read_values(pool, [pack_get(n, None) for n in names], places=places, guard=guard)
        assert isinstance(replies[0], Placed) and bytes(replies[0].head) == b"HEAD"
        assert bytes(slots[0]) == b"a" * 5000
        assert replies[1] is None
        assert isinstance(replies[2], memoryview) and bytes(replies[2]) == b"HEAD" + b"b" * 4999
        conn = pool.get_connection()
        try:
            assert conn._sock.gettimeout() == 2  # type: ignore[attr-defined]
        finally:
            pool.release(conn)
    finally:
        guard.close()
        pool.disconnect()


_job_ids = iter(range(1, 1 << 30))


def _job(keys: list[OffloadKey], slots: range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), ReqContext(request_id="t"))


@pytest.mark.anyio
@pytest.mark.parametrize("fit", [False, True])
@pytest.mark.parametrize("block", [64 << 10, MiB, 2 * MiB, 8 * MiB])
async def test_round_trips_are_byte_identical(
    redis_server: RedisServer, block: int, fit: bool
) -> None:
    """The sizes the README quotes; 8 MiB blocks are split in two parts (the default
    `part_size` is 8 MiB and the frame is a little more), each read into its slot; with
    `fit_values` MiB-sized frames are fitted to Redis's allocator (a small last part).
    MiB-sized blocks are sent in turn, stored straight from their slots."""
    rng = random.Random(block)
    view = PrimaryTier(8, block, pin_memory=False, namespace=f"sockets-{os.urandom(3).hex()}").view
    config = {"url": redis_server.url, "fit_values": fit}
    tier = RedisTier(RedisTierConfig.model_validate(config), view)
    await tier.open()
    try:
        keys = random_keys(4, rng)
        data = fill_slots(view, range(4), rng)
        assert (await tier.store(_job(keys, range(4)))).ok
        names = tier._names.all(keys[0])
        split = 2 if block == 8 * MiB else 1
        assert len(names) == (split + (block >= MiB) if fit else split)
        client = tier._client_for(names[0])
        lengths = [await client.strlen(name) for name in names]
        assert sum(lengths) == tier._names.part_bounds(keys[0])[-1][1]
        if fit and len(names) > 1:  # full parts ALLOC_SLACK short of a size class, a tail
            assert all(size_class(n + ALLOC_SLACK) == n + ALLOC_SLACK for n in lengths[:-1])
            assert 0 < lengths[-1] <= FIT_MAX_TAIL
        result = await tier.load(_job(keys, range(4, 8)))
        assert result.ok, result.error
        for i in range(4):
            assert bytes(view.block(4 + i)) == data[i]
    finally:
        await tier.close()


# -- stores sent straight from their slots (`wire.send_straight`) ---------------------
class _SilentServer:
    """A Redis that reads `reads` bytes of a SET (all of it when None) and then stops
    reading: a server that froze mid-command. `received` counts the SET's bytes."""

    def __init__(self, reads: int | None = 0) -> None:
        self.reads = reads
        self.received = 0
        self._peer = HandshakePeer(b"$3\r\nSET\r\n", self._take)
        self.port = self._peer.port

    def _take(self, conn: socket.socket, first: bytes) -> None:
        self.received = len(first)
        while self.reads is None or self.received < self.reads:
            data = conn.recv(65536)
            if not data:
                return
            self.received += len(data)

    def close(self) -> None:
        self._peer.close()


def _straight_store(
    port: int, guard: SocketGuard, slot: bytearray
) -> tuple[threading.Thread, list[BaseException | object]]:
    """A thread SETting `slot` (as one block, straight from it) through `port`."""
    url = f"redis://127.0.0.1:{port}/0"
    pool = BlockingConnectionPool.from_url(url, protocol=2, socket_timeout=30)
    out: list[BaseException | object] = []

    def pieces() -> list[Pieces]:
        return [set_pieces(b"straight", b"HEAD", memoryview(slot), None)]

    def store() -> None:
        try:
            out.append(send_straight(pool, [pieces], guard))
        except BaseException as exc:
            out.append(exc)
        finally:
            pool.disconnect()

    thread = threading.Thread(target=store)
    thread.start()
    return thread, out


def test_a_job_ending_mid_send_cuts_it_and_keeps_no_view_of_the_slot() -> None:
    """A store sent straight from its slot to a server that stopped reading: the job's
    end cuts the send at once (not after the 30 s socket timeout), and no view of the
    slot is left (a bytearray with a view exported cannot be resized)."""
    server = _SilentServer(reads=MiB)
    slot = bytearray(b"s" * (64 * MiB))  # more than the socket buffers hold
    guard = SocketGuard()
    thread, out = _straight_store(server.port, guard, slot)
    try:
        deadline = time.monotonic() + 10
        while server.received < MiB and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.received >= MiB, "the send never started"
        time.sleep(0.1)  # the send now waits on the full buffers
        assert thread.is_alive()
        started = time.monotonic()
        guard.close()
        assert time.monotonic() - started < 1.0
        thread.join(5)
        assert not thread.is_alive()
        assert len(out) == 1 and isinstance(out[0], SlotsClosed)
        slot.extend(b"x")  # raises BufferError while any view of the slot lives
    finally:
        guard.close()
        server.close()


def test_a_job_that_ended_before_the_send_sends_nothing() -> None:
    server = _SilentServer(reads=None)
    slot = bytearray(b"s" * 1000)
    guard = SocketGuard()
    guard.close()
    thread, out = _straight_store(server.port, guard, slot)
    try:
        thread.join(5)
        assert len(out) == 1 and isinstance(out[0], SlotsClosed)
        time.sleep(0.1)
        assert server.received == 0  # not one byte of the SET
        slot.extend(b"x")
    finally:
        server.close()


@pytest.mark.anyio
@pytest.mark.parametrize("fit", [True, False])
async def test_split_blocks_share_a_call_sent_in_turn(redis_server: RedisServer, fit: bool) -> None:
    """1 MiB blocks in parts of at most 256 KiB (fitted: 8 of 128 KiB less the slack,
    and the small last part; 5 of ~205 KiB unfitted): 12 blocks go 3 to a call, each
    SET (or GET) sent after the last one's reply; every block reads back
    byte-identical."""
    rng = random.Random(31)
    view = PrimaryTier(24, MiB, pin_memory=False, namespace=f"turn-{os.urandom(3).hex()}").view
    config = RedisTierConfig.model_validate(
        {"url": redis_server.url, "part_size": "256KiB", "fit_values": fit}
    )
    tier = RedisTier(config, view)
    assert tier._plan.in_turn and tier._plan.batch_size(12) == 3
    await tier.open()
    try:
        keys = random_keys(12, rng)
        assert len(tier._names.all(keys[0])) == (9 if fit else 5)
        data = fill_slots(view, range(12), rng)
        assert (await tier.store(_job(keys, range(12)))).ok
        assert await tier.lookup(keys, ReqContext(request_id="t")) == [True] * 12
        result = await tier.load(_job(keys, range(12, 24)))
        assert result.ok, result.error
        assert [bytes(view.block(12 + i)) for i in range(12)] == [data[i] for i in range(12)]
    finally:
        await tier.close()


class _LoggingConnection(redis.Connection):
    """A connection that logs its sends and the replies it reads, in order."""

    log: ClassVar[list[str]] = []

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        type(self).log.append("send")
        super().send_packed_command(command, check_health)  # type: ignore[arg-type]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        type(self).log.append("read")
        return super().read_response(*args, **kwargs)


@pytest.mark.parametrize("straight", [True, False])
def test_a_small_set_in_turn_is_sent_with_the_next_and_its_reply_read_after(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, straight: bool
) -> None:
    """A fitted block's SETs (its small last part first, then its large part) go in
    one turn: both sent, then both replies read, in order; a large SET waits for its
    reply before the next is sent. Straight from the slot, or packed (`send_sets`)."""
    log = _LoggingConnection.log
    log.clear()
    sending = wire._send_pieces

    def logged(sock: socket.socket, pieces: Pieces, where: str) -> None:
        log.append("send")
        sending(sock, pieces, where)

    monkeypatch.setattr(wire, "_send_pieces", logged)
    big, small = os.urandom(1 << 20), os.urandom(300)
    commands = [
        set_pieces(b"ahead:tail", b"", memoryview(small), None),
        set_pieces(b"ahead:main", b"", memoryview(big), None),
        set_pieces(b"ahead:next", b"", memoryview(big), None),
    ]
    pool = BlockingConnectionPool.from_url(
        redis_server.url, connection_class=_LoggingConnection, max_connections=2
    )
    guard = SocketGuard()
    conn = pool.get_connection()
    conn.connect()  # the handshake's sends and reads, before the log starts
    pool.release(conn)
    log.clear()
    try:
        if straight:
            outcomes = send_straight(pool, [lambda: commands[:2], lambda: commands[2:]], guard)
        else:
            outcomes = send_sets(pool, [b"".join(c) for c in commands], in_turn=True)
        assert outcomes == [None, None, None]
        assert log == ["send", "send", "read", "read", "send", "read"]
        with redis.Redis.from_url(redis_server.url) as client:
            assert client.get("ahead:tail") == small and client.get("ahead:main") == big
    finally:
        guard.close()
        pool.disconnect()
