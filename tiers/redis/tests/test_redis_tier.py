"""The redis tier against a real redis-server: the shared conformance suite (single
node, blocks split in parts with a ttl, and a Redis Cluster), then what only a shared
network tier has to get right: untrusted values, namespaces, parts, expiry, memory
limits, a server that dies, freezes or restarts, passwords, and two processes sharing
blocks."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis
from tierkv_redis import RedisTier, RedisTierConfig
from tierkv_redis.config import LARGE_CALLS, Plan, transfer_plan
from tierkv_redis.testing import RedisServer

from tierkv.contract.errors import ConfigError, TierUnavailable
from tierkv.contract.framing import encode_block
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.primary import PrimaryTier, PrimaryView
from tierkv.registry import get_tier_class, installed_tiers
from tierkv.testing import TierConformanceSuite, fill_slots, random_keys
from tierkv.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio

CTX = ReqContext(request_id="redis-tests")
HERE = Path(__file__).parent
_job_ids = iter(range(1, 1 << 30))


def job(keys: list[OffloadKey], slots: list[int] | range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


def make_primary(namespace: str = "redis-tests", slots: int = 32, block: int = 4096) -> PrimaryTier:
    return PrimaryTier(slots, block, pin_memory=False, namespace=namespace)


def redis_tier(url: str, view: PrimaryView, **settings: object) -> RedisTier:
    return RedisTier(RedisTierConfig.model_validate({"url": url, **settings}), view)


async def raw_client(url: str, password: str | None = None) -> Redis:
    return Redis.from_url(url, password=password)


# -- the conformance suite, four ways -------------------------------------------------
class _RedisConformance(TierConformanceSuite):
    supports_capacity = False  # Redis bounds memory itself (maxmemory), not the tier
    tier_settings: ClassVar[dict[str, object]] = {}
    url = ""

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        settings = {**self.tier_settings, **fields}
        return redis_tier(self.url, primary, socket_timeout="2s", **settings)

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        assert isinstance(tier, RedisTier)
        last_part = tier._names.all(key)[-1]
        client = tier._client_for(last_part)  # the server's, or the slot master's
        value = await client.get(last_part)
        assert isinstance(value, bytes)
        await client.set(last_part, value[:-1] + bytes([value[-1] ^ 0xFF]))

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        assert isinstance(tier, RedisTier)
        names = tier._names.all(key)
        size = tier._names.part_size
        client = tier._client_for(names[0])  # all parts share one slot
        for i, name in enumerate(names):  # split the way the tier splits its frames
            end = None if i == len(names) - 1 else (i + 1) * size
            await client.set(name, frame[i * size : end])


class TestRedisConformance(_RedisConformance):
    """One value per block, concurrent single commands (the defaults)."""


class TestRedisPipelinedConformance(_RedisConformance):
    """Stores and loads in pipelines of 4 commands."""

    tier_settings: ClassVar[dict[str, object]] = {"pipeline_size": 4, "max_connections": 3}


class TestRedisPartsConformance(_RedisConformance):
    """Every 4 KiB block split into 5 parts of 1 KiB, with a ttl (SET PX, GETEX)."""

    tier_settings: ClassVar[dict[str, object]] = {"part_size": 1024, "ttl": "1h"}


class TestRedisClusterConformance(_RedisConformance):
    """Through RedisCluster against a one-node cluster, with parts and pipelines."""

    tier_settings: ClassVar[dict[str, object]] = {
        "cluster": True,
        "part_size": 2048,
        "pipeline_size": 2,
    }

    @pytest.fixture(autouse=True)
    def _server(self, redis_cluster: RedisServer) -> None:
        self.url = redis_cluster.url


# -- configuration and registration ------------------------------------------------
def test_entry_point_resolves_to_the_redis_tier() -> None:
    assert get_tier_class("redis") is RedisTier
    info = installed_tiers()["redis"]
    assert info.target == "tierkv_redis:RedisTier"
    assert info.distribution == "tierkv-cache-redis"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"url": "http://127.0.0.1:6379"}, "is not a Redis URL"),
        ({"url": "redis://"}, "names no host"),
        ({"url": "redis://:pw@127.0.0.1/0", "password": "pw"}, "password is given twice"),
        ({"key_prefix": "kv{x}:"}, "hash tag"),
        ({"part_size": 100}, "at least 1024"),
        ({"socket_timeout": 0}, "greater than 0"),
        ({"max_connections": 0}, "greater than 0"),
        ({"pipline_size": 4}, "Extra inputs are not permitted"),
        ({"pipeline_size": "fast"}, "Input should be 'auto'"),
        ({"pipeline_size": 0}, "greater than 0"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        RedisTierConfig.model_validate(fields)


@pytest.mark.parametrize(
    ("setting", "block_bytes", "per_pipeline"),
    [
        ("auto", 4096, 64),  # capped
        ("auto", 64 << 10, 32),  # about 2 MiB per pipeline
        ("auto", 256 << 10, 8),
        ("auto", 1 << 20, 16),  # MiB-sized: up to 16 MiB a call, sent in turn
        ("auto", 8 << 20, 2),
        (3, 64 << 10, 3),  # a number is taken as it is
        (1, 1 << 20, 1),
    ],
)
def test_pipeline_size_auto_sizes_pipelines_by_bytes(
    setting: object, block_bytes: int, per_pipeline: int
) -> None:
    primary = PrimaryTier(2, block_bytes, pin_memory=False, namespace="pipe")
    config = RedisTierConfig.model_validate({"pipeline_size": setting})
    tier = RedisTier(config, primary.view)
    assert tier.describe()["blocks_per_pipeline"] == per_pipeline
    in_turn = setting == "auto" and block_bytes >= 1 << 20
    assert tier.describe()["commands_in_turn"] is in_turn
    keys = random_keys(2 * per_pipeline + 1)
    batches = tier._batches((k, 0) for k in keys)
    assert [len(b) for b in batches] == [per_pipeline, per_pipeline, 1]


def test_large_blocks_are_spread_over_a_few_calls_each_sending_in_turn() -> None:
    plan = transfer_plan("auto", 1 << 20, max_connections=16)
    assert plan == Plan(blocks=16, calls=LARGE_CALLS, in_turn=True)
    assert plan.batch_size(16) == 16 // LARGE_CALLS  # one job of 16 blocks: LARGE_CALLS calls
    assert plan.batch_size(3) == 1
    assert plan.batch_size(1000) == 16  # never more than 16 MiB a call
    assert transfer_plan("auto", 8 << 20, max_connections=16).batch_size(1000) == 2
    assert transfer_plan("auto", 1 << 20, max_connections=2).calls == 2  # the pool's bound
    small = transfer_plan("auto", 64 << 10, max_connections=16)
    assert small == Plan(blocks=32, calls=16, in_turn=False)
    assert small.batch_size(1000) == 32
    assert transfer_plan(4, 8 << 20, max_connections=16) == Plan(4, 16, in_turn=False)


def test_yaml_config_expands_the_password_and_names_bad_paths() -> None:
    from tierkv.config import parse_config

    base = {
        "namespace": "n",
        "layout": {"block_bytes": 4096, "groups": [{"block_size": 16}]},
        "primary": {"capacity": "1MiB"},
    }
    config = parse_config(
        {**base, "tiers": [{"type": "redis", "url": "redis://10.1.2.3:6380/2",
                            "password": "${RKV_PW}", "ttl": "90m", "part_size": "4MiB"}]},
        env={"RKV_PW": "from-env"},
    )  # fmt: skip
    tier_config = config.tiers[0]
    assert isinstance(tier_config, RedisTierConfig)
    assert tier_config.password is not None
    assert tier_config.password.get_secret_value() == "from-env"
    assert tier_config.ttl == 5400.0
    assert int(tier_config.part_size) == 4 << 20
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "tiers": [{"type": "redis", "url": "mysql://x", "ttl": "soon"}]})
    text = str(err.value)
    assert "tiers[0].url" in text and "tiers[0].ttl" in text


async def test_secrets_never_appear_in_reprs_descriptions_errors_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "hunter2-do-not-log"
    view = make_primary().view
    by_url = redis_tier(f"redis://user:{secret}@127.0.0.1:1/0", view, socket_timeout="200ms")
    by_field = redis_tier("redis://127.0.0.1:1/0", view, password=secret)
    caplog.set_level(logging.DEBUG)
    shown = []
    for tier in (by_url, by_field):
        shown += [repr(tier.config), str(tier.config), repr(tier), json.dumps(tier.describe())]
        with pytest.raises(TierUnavailable) as err:
            await tier.open()  # port 1: nothing listens, the error names the server
        shown.append(str(err.value))
        assert "127.0.0.1:1" in str(err.value)
    assert "user:***@127.0.0.1:1" in repr(by_url.config)
    for text in [*shown, caplog.text]:
        assert secret not in text


# -- untrusted bytes, namespaces, parts ------------------------------------------------
async def test_forged_or_damaged_values_fail_their_keys_and_are_deleted(
    redis_server: RedisServer,
) -> None:
    rng = random.Random(11)
    primary = make_primary()
    view = primary.view
    tier = redis_tier(redis_server.url, view)
    await tier.open()
    try:
        keys = random_keys(6, rng)
        data = fill_slots(view, range(6), rng)
        assert (await tier.store(job(keys, range(6)))).ok
        client = tier._client_for(tier._names.main(keys[0]))
        assert client is not None
        name = tier._names.main
        value_of_1, value_of_4 = await client.get(name(keys[1])), await client.get(name(keys[4]))
        assert isinstance(value_of_1, bytes) and isinstance(value_of_4, bytes)
        await client.set(name(keys[0]), value_of_1)  # another key's frame
        await client.set(name(keys[2]), b"\x80\x04\x95" + b"a pickle, never unpickled" * 4)
        await client.set(name(keys[3]), encode_block(keys[3], data[3], "another-namespace"))
        await client.set(name(keys[4]), value_of_4[:-10])  # truncated
        sentinel = b"\xee" * view.block_bytes
        for slot in range(10, 16):
            view.block(slot)[:] = sentinel
        result = await tier.load(job(keys, range(10, 16)))
        forged = [keys[0], keys[2], keys[3], keys[4]]
        assert set(result.failed_keys) == set(forged)
        assert result.ok_keys == (keys[1], keys[5])
        assert result.error and "corrupt block deleted" in result.error
        for reason in ("expected", "bad magic", "another namespace", "payload is"):
            assert reason in result.error
        # a value of the frame's length is read straight into its slot and checked
        # there (the contract lets a failed key's slot hold anything); one of another
        # length never reaches the slot
        for slot in (12, 14):
            assert bytes(view.block(slot)) == sentinel
        assert bytes(view.block(11)) == data[1]
        assert bytes(view.block(15)) == data[5]
        assert await client.exists(*(name(k) for k in forged)) == 0
        assert await tier.lookup(keys, CTX) == [False, True, False, False, False, True]
    finally:
        await tier.close()


async def test_namespaces_never_see_each_other(redis_server: RedisServer) -> None:
    rng = random.Random(12)
    a, b = make_primary("model-a"), make_primary("model-b")
    tier_a = redis_tier(redis_server.url, a.view)
    tier_b = redis_tier(redis_server.url, b.view)
    await tier_a.open()
    await tier_b.open()
    try:
        keys = random_keys(4, rng)
        data = fill_slots(a.view, range(4), rng)
        assert (await tier_a.store(job(keys, range(4)))).ok
        assert await tier_b.lookup(keys, CTX) == [False] * 4
        assert set((await tier_b.load(job(keys, range(4)))).failed_keys) == set(keys)
        await tier_b.remove(keys)  # removes nothing of model-a's
        assert (await tier_a.load(job(keys, range(4, 8)))).ok
        assert [bytes(a.view.block(s)) for s in range(4, 8)] == [data[s] for s in range(4)]
        assert tier_a._names.prefix != tier_b._names.prefix
    finally:
        await tier_a.close()
        await tier_b.close()


async def test_a_missing_part_is_a_miss_never_a_corrupt_read(redis_server: RedisServer) -> None:
    rng = random.Random(13)
    view = make_primary().view
    tier = redis_tier(redis_server.url, view, part_size=1024)
    await tier.open()
    try:
        keys = random_keys(2, rng)
        data = fill_slots(view, range(2), rng)
        assert (await tier.store(job(keys, range(2)))).ok
        client = tier._client_for(tier._names.main(keys[0]))
        assert client is not None
        names = tier._names.all(keys[0])
        assert len(names) == 5 and await client.exists(*names) == 5
        await client.delete(names[2])  # as if maxmemory evicted one part
        view.block(10)[:] = b"\0" * view.block_bytes
        result = await tier.load(job(keys, [10, 11]))  # a load before any lookup
        assert result.failed_keys == (keys[0],)
        assert result.error and "1 of 5 parts missing" in result.error
        # the parts that were there may have been read into slot 10 (a failed key's
        # slot may hold anything): what counts is that its key failed
        assert bytes(view.block(11)) == data[1]
        assert await client.exists(*names) == 0  # the orphaned parts went too
    finally:
        await tier.close()


async def test_a_lookup_meeting_a_block_that_lost_a_part_deletes_the_rest(
    redis_server: RedisServer,
) -> None:
    """A part evicted before any load: the lookup says miss and deletes the other
    parts (reported removed) instead of leaving them until TTL or eviction; parts
    whose main value is absent may be a store in progress and are left."""
    rng = random.Random(14)
    view = make_primary().view
    tier = redis_tier(redis_server.url, view, part_size=1024)
    reported: list[OffloadKey] = []
    tier.set_removal_listener(reported.extend)
    await tier.open()
    try:
        keys = random_keys(3, rng)
        fill_slots(view, range(3), rng)
        assert (await tier.store(job(keys, range(3)))).ok
        client = tier._client_for(tier._names.main(keys[0]))
        assert client is not None
        lost_part, lost_main = tier._names.all(keys[0]), tier._names.all(keys[1])
        await client.delete(lost_part[3])  # evicted part: the rest is an orphan
        await client.delete(lost_main[0])  # no main: maybe still being written
        assert await tier.lookup(keys, CTX) == [False, False, True]
        assert await client.exists(*lost_part) == 0
        assert await client.exists(*lost_main) == 4
        assert reported == [keys[0]]
        assert await tier.lookup(keys[2:], CTX) == [True]
    finally:
        await tier.close()


async def test_servers_with_another_part_size_miss_split_blocks_and_delete_nothing(
    redis_server: RedisServer,
) -> None:
    rng = random.Random(21)
    view = make_primary().view
    small = redis_tier(redis_server.url, view, part_size=1024)
    large = redis_tier(redis_server.url, view)
    await small.open()
    await large.open()
    try:
        keys = random_keys(2, rng)
        data = fill_slots(view, range(2), rng)
        assert (await small.store(job(keys[:1], [0]))).ok  # split in 5 parts
        assert (await large.store(job(keys[1:], [1]))).ok  # one value
        assert await large.lookup(keys, CTX) == [False, True]
        assert await small.lookup(keys, CTX) == [True, False]
        assert (await large.load(job(keys[:1], [5]))).failed_keys == (keys[0],)
        assert (await small.load(job(keys[1:], [6]))).failed_keys == (keys[1],)
        result = await small.load(job(keys[:1], [7]))  # its block survived the other's miss
        assert result.ok and bytes(view.block(7)) == data[0]
        assert (await large.load(job(keys[1:], [8]))).ok and bytes(view.block(8)) == data[1]
    finally:
        await small.close()
        await large.close()


async def test_a_job_timeout_leaves_no_connection_with_unread_replies(
    start_redis: Callable[..., RedisServer],
) -> None:
    """Cancelled mid-command by job_timeout, the tier must not hand a connection
    with replies still in flight to the next job (which would read the old replies)."""
    server = start_redis()
    rng = random.Random(22)
    view = make_primary().view
    settings = {"socket_timeout": "5s", "job_timeout": "300ms", "max_connections": 4}
    for fields in ({**settings}, {**settings, "pipeline_size": 3}):
        tier = redis_tier(server.url, view, **fields)
        await tier.open()
        try:
            keys = random_keys(12, rng)
            fill_slots(view, range(12), rng)
            server.freeze()
            started = time.monotonic()
            late = await tier.store(job(keys, range(12)))
            assert time.monotonic() - started < 2
            assert len(late.failed_keys) == 12 and "job_timeout" in (late.error or "")
            server.thaw()  # the frozen commands now run, and their replies arrive
            for _ in range(3):
                others = random_keys(12, rng)
                data = fill_slots(view, range(12), rng)
                assert (await tier.store(job(others, range(12)))).ok
                back = await tier.load(job(others, range(12, 24)))
                assert back.ok, back.error
                assert [bytes(view.block(s)) for s in range(12, 24)] == [data[s] for s in range(12)]
        finally:
            server.thaw()
            await tier.close()


async def test_ttl_expires_blocks_and_a_load_renews_it(redis_server: RedisServer) -> None:
    rng = random.Random(14)
    view = make_primary().view
    tier = redis_tier(redis_server.url, view, ttl="1s", part_size=2048)
    await tier.open()
    try:
        [key] = random_keys(1, rng)
        fill_slots(view, [0], rng)
        assert (await tier.store(job([key], [0]))).ok
        client = tier._client_for(tier._names.main(key))
        assert client is not None
        names = tier._names.all(key)
        ttls = [await client.pttl(n) for n in names]
        assert all(0 < t <= 1000 for t in ttls), ttls
        await anyio.sleep(0.5)
        assert (await tier.load(job([key], [1]))).ok
        ttls = [await client.pttl(n) for n in names]
        assert all(t > 700 for t in ttls), f"a hit renews every part's ttl: {ttls}"
        await anyio.sleep(1.3)
        assert await tier.lookup([key], CTX) == [False]
    finally:
        await tier.close()


@pytest.mark.parametrize(
    ("block", "maxmemory"),
    [(256 << 10, "3mb"), (1 << 20, "8mb")],  # pipelined, and sent in turn from the slots
)
async def test_a_full_redis_fails_keys_with_a_clear_error(
    start_redis: Callable[..., RedisServer], block: int, maxmemory: str
) -> None:
    server = start_redis(extra_args=("--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"))
    primary = make_primary(slots=24, block=block)
    rng = random.Random(15)
    tier = redis_tier(server.url, primary.view)
    await tier.open()
    try:
        keys = random_keys(24, rng)
        data = fill_slots(primary.view, range(24), rng)
        result = await tier.store(job(keys, range(24)))
        assert result.failed_keys and result.ok_keys
        assert result.error and "out of memory" in result.error
        ok = list(result.ok_keys)
        back = await tier.load(job(ok, range(len(ok))))
        assert back.ok, back.error
        for slot, key in enumerate(ok):
            assert bytes(primary.view.block(slot)) == data[keys.index(key)]
    finally:
        await tier.close()


# -- a server that dies, freezes, restarts -------------------------------------------
async def test_a_stopped_server_fails_jobs_fast_and_the_tier_recovers_by_itself(
    start_redis: Callable[..., RedisServer],
) -> None:
    server = start_redis()
    rng = random.Random(16)
    view = make_primary().view
    tier = redis_tier(server.url, view, socket_timeout="500ms")
    await tier.open()
    try:
        before = random_keys(4, rng)
        fill_slots(view, range(4), rng)
        assert (await tier.store(job(before, range(4)))).ok
        server.stop()

        started = time.monotonic()
        result = await tier.store(job(random_keys(8, rng), range(8)))
        load = await tier.load(job(before, range(8, 12)))
        assert time.monotonic() - started < 3
        assert not result.ok_keys and len(result.failed_keys) == 8
        assert not load.ok_keys
        for error in (result.error, load.error):
            assert error and "unreachable" in error and f"127.0.0.1:{server.port}" in error
        with pytest.raises(TierUnavailable, match="unreachable"):
            await tier.lookup(before, CTX)
        with pytest.raises(TierUnavailable, match="unreachable"):
            await tier.remove(before)

        server.start()  # same port, empty: persistence is off
        after = random_keys(4, rng)
        data = fill_slots(view, range(4), rng)
        assert (await tier.store(job(after, range(4)))).ok, "no reopen needed"
        assert (await tier.load(job(after, range(8, 12)))).ok
        assert [bytes(view.block(s)) for s in range(8, 12)] == [data[s] for s in range(4)]
        assert await tier.lookup(before, CTX) == [False] * 4
    finally:
        await tier.close()


@pytest.mark.parametrize("block", [4096, 1 << 20])  # pipelined; in turn from the slots
async def test_a_frozen_server_fails_a_job_within_the_socket_timeout(
    start_redis: Callable[..., RedisServer], block: int
) -> None:
    server = start_redis()
    rng = random.Random(17)
    view = make_primary(block=block).view
    tier = redis_tier(server.url, view, socket_timeout="500ms", max_connections=4)
    await tier.open()
    try:
        keys = random_keys(32, rng)
        fill_slots(view, range(32), rng)
        server.freeze()
        started = time.monotonic()
        result = await tier.store(job(keys, range(32)))
        elapsed = time.monotonic() - started
        # 8 rounds of 4 connections would be 4 s if every batch waited its timeout
        assert elapsed < 2.0, f"took {elapsed:.2f}s"
        assert len(result.failed_keys) == 32 and "Timeout" in (result.error or "")
        with pytest.raises(TierUnavailable):
            await tier.lookup(keys, CTX)
        server.thaw()
        assert (await tier.store(job(keys, range(32)))).ok
        assert (await tier.load(job(keys, range(32)))).ok
    finally:
        server.thaw()
        await tier.close()


async def test_a_lookup_does_not_wait_again_on_a_server_it_saw_fail(
    start_redis: Callable[..., RedisServer],
) -> None:
    """A single server is one node without a breaker: the first failure ends the
    lookup (its batches still queued for a connection are not sent), and the next
    operation asks the server again."""
    server = start_redis()
    rng = random.Random(24)
    view = make_primary().view
    settings = {"socket_timeout": "400ms", "lookup_batch": 1, "max_connections": 2}
    tier = redis_tier(server.url, view, **settings)
    await tier.open()
    try:
        keys = random_keys(8, rng)  # 8 pipelines, 2 connections: 4 rounds if each waited
        fill_slots(view, range(8), rng)
        assert (await tier.store(job(keys, range(8)))).ok
        server.freeze()
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match=r"lookup failed: redis at .* unreachable"):
            await tier.lookup(keys, CTX)
        assert time.monotonic() - started < 1.0, "one socket timeout, not one per pipeline"
        server.thaw()
        assert await tier.lookup(keys, CTX) == [True] * 8
    finally:
        server.thaw()
        await tier.close()


async def test_a_server_killed_mid_job_ends_the_job_and_a_restart_heals(
    start_redis: Callable[..., RedisServer],
) -> None:
    server = start_redis()
    rng = random.Random(18)
    primary = make_primary(slots=32, block=128 * 1024)
    view = primary.view
    tier = redis_tier(server.url, view, socket_timeout="5s", max_connections=4)
    await tier.open()
    try:
        keys = random_keys(32, rng)
        fill_slots(view, range(32), rng)
        results = []
        server.freeze()  # the job is now waiting on the server, mid-flight

        async def run() -> None:
            results.append(await tier.store(job(keys, range(32))))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.3)
            server.stop()  # killed: its sockets close under the waiting job
        assert time.monotonic() - started < 4, "the job must not wait out the 5 s timeout"
        [result] = results
        assert sorted(result.ok_keys + result.failed_keys) == sorted(keys)
        assert len(result.failed_keys) == len(keys), "a frozen, then killed server stored nothing"
        assert result.error and f"127.0.0.1:{server.port}" in result.error
        server.start()
        assert (await tier.store(job(keys, range(32)))).ok
        assert await tier.lookup(keys, CTX) == [True] * 32
    finally:
        await tier.close()


# -- passwords ----------------------------------------------------------------------
async def test_requirepass_wrong_or_missing_password_is_a_clear_auth_error(
    start_redis: Callable[..., RedisServer],
) -> None:
    server = start_redis(password="right-pw")
    host = f"127.0.0.1:{server.port}/0"
    view = make_primary().view
    for url in (f"redis://{host}", f"redis://:wrong-pw@{host}"):
        tier = redis_tier(url, view)
        with pytest.raises(TierUnavailable, match="refused the credentials") as err:
            await tier.open()
        assert "wrong-pw" not in str(err.value)
        with pytest.raises(TierUnavailable, match="not open"):
            await tier.store(job(random_keys(1), [0]))
    rng = random.Random(19)
    for tier in (
        redis_tier(f"redis://:right-pw@{host}", view),
        redis_tier(f"redis://{host}", view, password="right-pw"),
    ):
        await tier.open()
        try:
            keys = random_keys(3, rng)
            data = fill_slots(view, range(3), rng)
            assert (await tier.store(job(keys, range(3)))).ok
            assert (await tier.load(job(keys, range(3, 6)))).ok
            assert [bytes(view.block(s)) for s in range(3, 6)] == [data[s] for s in range(3)]
        finally:
            await tier.close()


@pytest.mark.parametrize("block", [4096, 1 << 20])  # pipelined; in turn from the slots
async def test_rediss_with_a_password_round_trips_and_a_bad_certificate_is_refused(
    start_redis: Callable[..., RedisServer], block: int
) -> None:
    server = start_redis(tls=True, password="tls-pw")
    rng = random.Random(23)
    view = make_primary(slots=8, block=block).view
    secure = server.url.replace("rediss://", "rediss://:tls-pw@")
    tier = redis_tier(secure, view)
    assert "tls-pw" not in repr(tier.config) and ":***@" in repr(tier.config)
    await tier.open()
    try:
        keys = random_keys(3, rng)
        data = fill_slots(view, range(3), rng)
        assert (await tier.store(job(keys, range(3)))).ok
        assert (await tier.load(job(keys, range(3, 6)))).ok
        assert [bytes(view.block(s)) for s in range(3, 6)] == [data[s] for s in range(3)]
    finally:
        await tier.close()
    untrusted = redis_tier(f"rediss://:tls-pw@127.0.0.1:{server.port}/0", view)
    with pytest.raises(TierUnavailable, match=r"unreachable.*(SSL|certificate)"):
        await untrusted.open()  # the self-signed certificate is not in the default CAs
    plaintext = redis_tier(f"redis://:tls-pw@127.0.0.1:{server.port}/0", view, socket_timeout=1)
    with pytest.raises(TierUnavailable):
        await plaintext.open()


# -- life cycle ----------------------------------------------------------------------
async def test_open_is_idempotent_and_close_refuses_later_work(redis_server: RedisServer) -> None:
    view = make_primary().view
    tier = redis_tier(redis_server.url, view)
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.lookup(random_keys(1), CTX)
    await tier.open()
    await tier.open()
    assert tier.describe()["open"] is True
    await tier.close()
    with pytest.raises(TierUnavailable, match="closed"):
        await tier.store(job(random_keys(1), [0]))
    await tier.open()  # a closed tier may be opened again
    assert await tier.lookup(random_keys(2), CTX) == [False, False]
    await tier.close()


# -- two processes share one Redis --------------------------------------------------
def _start_node(mode: str, url: str, namespace: str, work: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONHASHSEED": "random"}  # keys must not depend on hash()
    return subprocess.Popen(
        [sys.executable, str(HERE / "share_node.py"), mode, url, namespace, str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _answer(node: subprocess.Popen[str]) -> dict[str, object]:
    try:
        out, err = node.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        node.kill()
        raise
    assert node.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_two_processes_share_blocks_and_another_namespace_sees_none(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Process A's TieredCache stores blocks (cascaded to redis); process B, a fresh
    interpreter with an empty primary, loads them byte-identical, promoted from redis;
    process C, same keys but another namespace, finds none of them."""
    rng = random.Random(20)
    tokens = [rng.randrange(32000) for _ in range(16 * 6)]
    keys = [make_offload_key(h, 0) for h in hash_token_blocks(tokens, 16, namespace="shared")]
    block_bytes = 64 * 1024
    blob = rng.randbytes(block_bytes * len(keys))
    (tmp_path / "block_bytes.txt").write_text(str(block_bytes))
    (tmp_path / "keys.txt").write_text("\n".join(k.hex() for k in keys))
    (tmp_path / "blocks.bin").write_bytes(blob)
    url = redis_server.url

    assert _answer(_start_node("store", url, "shared", tmp_path)) == {"stored": 6, "error": None}
    b = _start_node("load", url, "shared", tmp_path)
    c = _start_node("load", url, "other-tenant", tmp_path)
    assert _answer(b) == {"hit_blocks": 6, "ok": 6, "failed": 0, "sources": ["redis"]}
    assert (tmp_path / "loaded-shared.bin").read_bytes() == blob
    assert _answer(c) == {"hit_blocks": 0, "ok": 0, "failed": 6, "sources": []}
