"""The redis tier on a real Redis Cluster (`RedisClusterServers`: redis-server processes
on loopback, three masters, with or without replicas): a node that is down costs the
blocks of its own slots only, through the tier and through a `TieredCache`; the tier's
breaker per node says which one is down and answers for it without asking it; a master
restarted empty, or a replica's failover, serves the slots again without reopening
anything; only a cluster whose every node is down is unavailable (issue 20, item 1)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from pydantic import ValidationError
from redis.crc import key_slot
from tierkv_redis import RedisTier, RedisTierConfig
from tierkv_redis.names import BlockNames
from tierkv_redis.testing import RedisClusterServers, RedisServer

from tierkv import TieredCache, parse_config
from tierkv.contract.errors import TierUnavailable
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryTier, PrimaryView
from tierkv.testing import fill_slots, random_keys

pytestmark = pytest.mark.anyio

StartCluster = Callable[..., RedisClusterServers]
CTX = ReqContext(request_id="redis-cluster-tests")
N = 96  # blocks: about 32 per master
BLOCK = 4096
TOKENS = 16
_job_ids = iter(range(1, 1 << 30))


def job(keys: list[OffloadKey], slots: list[int] | range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


def cluster_tier(cluster: RedisClusterServers, view: PrimaryView, **settings: Any) -> RedisTier:
    fields = {
        "url": cluster.url,  # master 0: the tests kill it too
        "cluster": True,
        "socket_timeout": "1s",
        "job_timeout": "10s",
        "recovery_after": "300ms",  # the node breakers' probe interval
        **settings,
    }
    return RedisTier(RedisTierConfig.model_validate(fields), view)


def master_of(cluster: RedisClusterServers, names: BlockNames, key: OffloadKey) -> int:
    """Which master (index in `cluster.servers`) was given the slot of `key`."""
    slot = key_slot(names.main(key).encode())
    return next(i for i, (lo, hi) in enumerate(cluster.slot_ranges) if lo <= slot <= hi)


def name(server: RedisServer) -> str:
    return f"127.0.0.1:{server.port}"


async def until(done: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll `done` until it says True; the seconds that took."""
    started = time.monotonic()
    while not await done():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        await anyio.sleep(0.05)
    return time.monotonic() - started


def wait_replicated(cluster: RedisClusterServers) -> None:
    """Until every replica holds as many values as its master."""

    def dbsize(server: RedisServer) -> int:
        return int(server._command("DBSIZE").strip()[1:])

    deadline = time.monotonic() + 10
    for server, master in zip(cluster.servers, cluster.master_of):
        if master is None:
            continue
        while dbsize(server) != dbsize(cluster.servers[master]):
            assert time.monotonic() < deadline, "replication did not catch up"
            time.sleep(0.02)


# -- the tier -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings",
    [{}, {"part_size": 1024, "pipeline_size": 4}],
    ids=["one-value-per-block", "five-parts-per-block-pipelined"],
)
async def test_a_dead_master_costs_only_its_keys_and_serves_again_once_restarted(
    start_cluster: StartCluster, settings: dict[str, Any]
) -> None:
    cluster = start_cluster()
    rng = random.Random(40)
    view = PrimaryTier(2 * N, BLOCK, pin_memory=False, namespace="cluster").view
    tier = cluster_tier(cluster, view, **settings)
    await tier.open()
    try:
        keys = random_keys(N, rng)
        data = fill_slots(view, range(N), rng)
        assert (await tier.store(job(keys, range(N)))).ok
        dead = 0  # the master the url names: the tier must not need it after open
        on_dead = [master_of(cluster, tier._names, key) == dead for key in keys]
        live = {key for key, d in zip(keys, on_dead) if not d}
        assert 16 < sum(on_dead) < N - 16
        masters = [name(server) for server in cluster.servers]
        assert tier.describe()["nodes"] == dict.fromkeys(masters, "closed")

        cluster.kill(dead)
        assert await tier.lookup(keys, CTX) == [not d for d in on_dead]  # no raise
        result = await tier.load(job(keys, range(N, 2 * N)))
        assert set(result.ok_keys) == live
        assert set(result.failed_keys) == set(keys) - live
        assert result.error and name(cluster.servers[dead]) in result.error
        for i, key in enumerate(keys):
            if key in live:
                assert bytes(view.block(N + i)) == data[i]
        nodes = tier.describe()["nodes"]
        assert nodes == {m: "open" if i == dead else "closed" for i, m in enumerate(masters)}

        # while its breaker is open the dead node is not asked: its keys fail at once
        again = await tier.load(job(keys, range(N, 2 * N)))
        assert set(again.ok_keys) == live
        assert again.error and "node breaker open" in again.error
        stored = await tier.store(job(keys, range(N)))
        assert set(stored.ok_keys) == live

        cluster.restart(dead, wait=False)  # empty, same port and node id

        async def served() -> bool:
            return (await tier.store(job(keys, range(N)))).ok

        await until(served, 20, "the restarted master's slots served again")
        assert await tier.lookup(keys, CTX) == [True] * N
        back = await tier.load(job(keys, range(N, 2 * N)))
        assert back.ok, back.error
        assert [bytes(view.block(N + i)) for i in range(N)] == [data[i] for i in range(N)]
        assert tier.describe()["nodes"] == dict.fromkeys(masters, "closed")
    finally:
        await tier.close()


async def test_a_cluster_with_every_node_down_is_unavailable_until_one_is_back(
    start_cluster: StartCluster,
) -> None:
    cluster = start_cluster()
    rng = random.Random(41)
    view = PrimaryTier(16, BLOCK, pin_memory=False, namespace="cluster").view
    tier = cluster_tier(cluster, view)
    await tier.open()
    try:
        keys = random_keys(8, rng)
        fill_slots(view, range(8), rng)
        assert (await tier.store(job(keys, range(8)))).ok
        for i in range(3):
            cluster.kill(i)
        with pytest.raises(TierUnavailable, match="every node of the redis cluster is unreachable"):
            await tier.lookup(keys, CTX)
        assert set(tier.describe()["nodes"].values()) == {"open"}
        result = await tier.store(job(keys, range(8)))  # aborted, not tried per node
        assert not result.ok_keys
        assert result.error and "every node of the redis cluster is unreachable" in result.error
        with pytest.raises(TierUnavailable, match="every node"):  # breakers: no waiting
            with anyio.fail_after(0.2):
                await tier.lookup(keys, CTX)

        # two masters back (a majority: one alone refuses with CLUSTERDOWN, as a dead
        # cluster): the tier is up again, for their keys
        for i in (1, 2):
            cluster.restart(i, wait=False)

        async def up() -> bool:
            try:
                await tier.lookup(keys, CTX)
            except TierUnavailable:
                return False
            return True

        await until(up, 20, "a lookup answered once a majority is back")
        cluster.restart(0, wait=False)
        cluster.wait_ok()
        data = fill_slots(view, range(8), rng)

        async def served() -> bool:
            return (await tier.store(job(keys, range(8)))).ok

        await until(served, 20, "every node serving again")
        assert (await tier.load(job(keys, range(8, 16)))).ok
        assert [bytes(view.block(8 + i)) for i in range(8)] == [data[i] for i in range(8)]
    finally:
        await tier.close()


async def test_a_frozen_master_costs_its_keys_after_one_deadline(
    start_cluster: StartCluster,
) -> None:
    """A master that accepts connections and never answers (SIGSTOP: a hung process or
    a partition) costs its keys only: a job's batches on it time out after
    `socket_timeout` while the other masters store theirs; a lookup cut off by its
    caller's deadline (the cache's lookup_timeout) while the other nodes answered opens
    its breaker, so the next lookup answers at once."""
    cluster = start_cluster()
    rng = random.Random(42)
    view = PrimaryTier(2 * N, BLOCK, pin_memory=False, namespace="cluster").view
    tier = cluster_tier(cluster, view)  # socket_timeout 1s
    await tier.open()
    frozen = cluster.servers[1]
    try:
        keys = random_keys(N, rng)
        fill_slots(view, range(N), rng)
        on_frozen = [master_of(cluster, tier._names, key) == 1 for key in keys]
        frozen.freeze()
        started = time.monotonic()
        result = await tier.store(job(keys, range(N)))
        assert time.monotonic() - started < 3
        assert set(result.failed_keys) == {k for k, f in zip(keys, on_frozen) if f}
        assert result.error and "Timeout" in result.error and name(frozen) in result.error

        await tier.close()  # a fresh tier: every breaker closed
        tier = cluster_tier(cluster, view)
        await tier.open()
        with anyio.move_on_after(0.5):  # as the cache's lookup_timeout does
            await tier.lookup(keys, CTX)
        assert tier.describe()["nodes"][name(frozen)] == "open"
        with anyio.fail_after(0.5):  # not the 1 s socket timeout
            assert await tier.lookup(keys, CTX) == [not f for f in on_frozen]
    finally:
        frozen.thaw()
        await tier.close()


async def test_a_replica_takes_over_a_dead_masters_slots_and_its_blocks(
    start_cluster: StartCluster,
) -> None:
    """With a replica per master, Redis promotes the dead master's replica by itself;
    the tier's slot map follows (no reopen) and the blocks replicated before the kill
    load from the new master."""
    cluster = start_cluster(replicas=1)
    rng = random.Random(43)
    view = PrimaryTier(2 * N, BLOCK, pin_memory=False, namespace="cluster").view
    tier = cluster_tier(cluster, view)
    await tier.open()
    try:
        keys = random_keys(N, rng)
        data = fill_slots(view, range(N), rng)
        assert (await tier.store(job(keys, range(N)))).ok
        wait_replicated(cluster)
        dead, heir = cluster.servers[0], cluster.servers[3]  # master 0 and its replica
        on_dead = [master_of(cluster, tier._names, key) == 0 for key in keys]

        cluster.kill(0)
        assert await tier.lookup(keys, CTX) == [not d for d in on_dead]

        async def whole() -> bool:
            return await tier.lookup(keys, CTX) == [True] * N

        await until(whole, 30, "the replica's failover found by the tier")
        back = await tier.load(job(keys, range(N, 2 * N)))
        assert back.ok, back.error
        assert [bytes(view.block(N + i)) for i in range(N)] == [data[i] for i in range(N)]
        nodes = tier.describe()["nodes"]
        assert nodes[name(heir)] == "closed" and name(dead) not in nodes
        assert (await tier.store(job(keys, range(N)))).ok
    finally:
        await tier.close()


async def test_read_from_replicas_reads_there_and_a_dead_replica_costs_nothing(
    start_cluster: StartCluster,
) -> None:
    cluster = start_cluster(replicas=1)
    rng = random.Random(44)
    view = PrimaryTier(2 * N, BLOCK, pin_memory=False, namespace="cluster").view
    tier = cluster_tier(cluster, view, read_from_replicas=True)
    await tier.open()
    try:
        keys = random_keys(N, rng)
        data = fill_slots(view, range(N), rng)
        assert (await tier.store(job(keys, range(N)))).ok
        wait_replicated(cluster)
        assert await tier.lookup(keys, CTX) == [True] * N
        result = await tier.load(job(keys, range(N, 2 * N)))
        assert result.ok, result.error
        assert [bytes(view.block(N + i)) for i in range(N)] == [data[i] for i in range(N)]
        for replica in cluster.servers[3:]:  # every replica served some of the reads
            stats = replica._command("INFO", "commandstats")
            assert b"cmdstat_exists:" in stats and b"cmdstat_get:" in stats
        assert tier.describe()["read_from_replicas"] is True

        cluster.kill(4)  # master 1's replica: its reads go to master 1
        assert await tier.lookup(keys, CTX) == [True] * N
        again = await tier.load(job(keys, range(N, 2 * N)))
        assert again.ok, again.error
        assert [bytes(view.block(N + i)) for i in range(N)] == [data[i] for i in range(N)]
        assert tier.describe()["nodes"][name(cluster.servers[4])] == "open"
    finally:
        await tier.close()


def test_read_from_replicas_needs_a_cluster() -> None:
    with pytest.raises(ValidationError, match="read_from_replicas needs `cluster: true`"):
        RedisTierConfig.model_validate({"read_from_replicas": True})


# -- through a TieredCache ------------------------------------------------------------
def cache_on(cluster: RedisClusterServers, namespace: str) -> TieredCache:
    return TieredCache(
        parse_config(
            {
                "namespace": namespace,
                "layout": {"block_bytes": BLOCK, "groups": [{"block_size": TOKENS}]},
                "primary": {"capacity": 3 * N * BLOCK, "pin_memory": False},
                "tiers": [
                    {
                        "type": "redis",
                        "url": cluster.url,
                        "cluster": True,
                        "socket_timeout": "1s",
                        "recovery_after": "300ms",
                    }
                ],
            }
        )
    )


async def test_a_tiered_cache_loses_only_a_dead_masters_blocks_and_needs_no_reopen(
    start_cluster: StartCluster,
) -> None:
    """One server stores 96 blocks through its cache; another's cache, with master 0
    killed, finds the prefix up to the first block on it, loads every block of the live
    masters byte-identical from redis, keeps the tier's breaker closed, and once the
    master is back stores blocks on all three again, without reopening."""
    cluster = start_cluster()
    rng = random.Random(45)
    namespace = "cluster-cache"
    names = BlockNames("tierkv:", namespace, BLOCK, 8 << 20)
    keys = random_keys(N, rng)
    keys.sort(key=lambda k: master_of(cluster, names, k) == 0)  # live masters' blocks first
    keys = keys[:8] + random.Random(46).sample(keys[8:], N - 8)  # then mixed
    on_dead = [master_of(cluster, names, key) == 0 for key in keys]
    live = {key for key, d in zip(keys, on_dead) if not d}
    blocks = [rng.randbytes(BLOCK) for _ in keys]
    async with cache_on(cluster, namespace) as writer:
        assert len((await writer.store(keys, blocks)).stored) == N
        await writer.flush()  # the cascade to redis has finished

    async with cache_on(cluster, namespace) as cache:
        cluster.kill(0)
        found = await cache.lookup([keys])
        assert found.hit_tokens == on_dead.index(True) * TOKENS
        destination = [bytearray(BLOCK) for _ in keys]
        result = await cache.load(keys, destination)
        assert set(result.ok_keys) == live
        assert set(result.failed_keys) == set(keys) - live
        assert set(result.sources.values()) == {"redis"}
        for i, key in enumerate(keys):
            if key in live:
                assert destination[i] == blocks[i]
        assert cache.stats().tiers["redis"]["breaker"] == "closed"
        tier = cache.tier("redis")
        assert tier.describe()["nodes"][name(cluster.servers[0])] == "open"

        cluster.restart(0, wait=False)

        async def lands_everywhere() -> bool:
            fresh = random_keys(N, rng)
            await cache.store(fresh, [rng.randbytes(BLOCK) for _ in fresh])
            await cache.flush()
            return await tier.lookup(fresh, CTX) == [True] * N

        await until(lands_everywhere, 20, "stores on every master again")
        assert cache.stats().tiers["redis"]["breaker"] == "closed"
        assert set(tier.describe()["nodes"].values()) == {"closed"}
