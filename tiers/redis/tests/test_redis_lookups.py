"""`lookups.py`: EXISTS packed by the tier and run in a worker thread over the node's
blocking pool, against a real redis-server: answers right across several pipelines,
split blocks (whole, half gone), a reply that is no integer, and the event loop left
free while Redis answers."""

from __future__ import annotations

import os
import random
import threading

import pytest
import redis
from redis.connection import BlockingConnectionPool
from redis.exceptions import InvalidResponse
from tierkv_redis import RedisTier, RedisTierConfig, lookups
from tierkv_redis.lookups import pack_exists
from tierkv_redis.names import BlockNames
from tierkv_redis.testing import HandshakePeer, RedisServer

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryTier
from tierkv.testing import fill_slots, random_keys

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="lookups")
_job_ids = iter(range(1, 1 << 30))


def _job(keys: list[OffloadKey], slots: range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


def test_pack_exists_is_what_redis_py_sends() -> None:
    conn = redis.connection.Connection()
    names = ["a", "tierkv:x:{00ff}:p1024", "tierkv:x:{00ff}:p1024:1"]
    assert pack_exists(names) == b"".join(conn.pack_command("EXISTS", *names))


async def test_lookups_over_several_pipelines_answer_every_key(redis_server: RedisServer) -> None:
    """600 keys in pipelines of 64 (some stored, some not), and split blocks: whole
    ones are hits, one that lost a part is a miss and its rest is deleted."""
    rng = random.Random(41)
    view = PrimaryTier(40, 4096, pin_memory=False, namespace=f"lk-{os.urandom(3).hex()}").view
    small = RedisTier(
        RedisTierConfig.model_validate({"url": redis_server.url, "lookup_batch": 64}), view
    )
    split = RedisTier(
        RedisTierConfig.model_validate({"url": redis_server.url, "part_size": "1KiB"}), view
    )
    await small.open()
    await split.open()
    try:
        keys = random_keys(600, rng)
        stored = keys[::3]
        for i in range(0, len(stored), 40):
            chunk = stored[i : i + 40]
            fill_slots(view, range(len(chunk)), rng)
            assert (await small.store(_job(chunk, range(len(chunk))))).ok
        answer = await small.lookup(keys, CTX)
        assert answer == [k in set(stored) for k in keys]

        parted = random_keys(3, rng)
        fill_slots(view, range(3), rng)
        assert (await split.store(_job(parted, range(3)))).ok
        names = split._names.all(parted[1])
        assert len(names) == 5
        client = redis.Redis.from_url(redis_server.url)
        try:
            client.delete(names[2])  # one part evicted
            assert await split.lookup(parted, CTX) == [True, False, True]
            assert client.exists(*names) == 0  # the rest of the block went with it
        finally:
            client.close()
    finally:
        await small.close()
        await split.close()


async def test_exists_run_off_the_event_loop(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran_on: list[threading.Thread] = []
    real = lookups.exists

    def spy(*args: object) -> lookups.Found:
        ran_on.append(threading.current_thread())
        return real(*args)  # type: ignore[arg-type,unused-ignore]

    monkeypatch.setattr(lookups, "exists", spy)
    view = PrimaryTier(4, 4096, pin_memory=False, namespace=f"lk-{os.urandom(3).hex()}").view
    tier = RedisTier(RedisTierConfig.model_validate({"url": redis_server.url}), view)
    await tier.open()
    try:
        assert await tier.lookup(random_keys(5, random.Random(42)), CTX) == [False] * 5
    finally:
        await tier.close()
    assert ran_on and all(t is not threading.main_thread() for t in ran_on)


def test_a_reply_that_is_no_integer_raises_a_clear_error() -> None:
    """Something on the port that answers EXISTS with a string (a broken proxy)."""
    peer = HandshakePeer(b"EXISTS", lambda conn, _: conn.sendall(b"$3\r\nyes\r\n"))
    pool = BlockingConnectionPool.from_url(peer.url, protocol=2)
    names = BlockNames("tierkv:", "ns", 4096, 8 << 20)
    try:
        with pytest.raises(InvalidResponse, match="EXISTS answered b'yes', not an integer"):
            lookups.exists(pool, names, random_keys(1, random.Random(43)))
    finally:
        pool.disconnect()
        peer.close()
