"""The cache core at its edges: close while jobs run, cancelled stores and loads, tiers
that misbehave (evict before answering, answer a key twice, hang, lose their
directory), write-back across close and while a tier is down. Each test is a defect a
server would meet, written before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def chain(tiers: list[dict[str, Any]], blocks: int = 8, **top: Any) -> dict[str, Any]:
    return {
        "namespace": "review",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": blocks * BLOCK, "pin_memory": False},
        "tiers": tiers,
        **top,
    }


def assert_idle(cache: TieredCache) -> None:
    """Nothing pinned, nothing leaked: every slot is free or evictable."""
    p = cache.primary
    assert p.num_free + p.num_evictable == p.num_blocks
    assert all(p.readers(k) == 0 and p.is_ready(k) for k in p.keys_in_slots())
    assert cache.core.index.promoting == 0
    assert cache.core.index.promoting == 0


async def test_a_load_still_promoting_when_close_begins_ends_with_failed_keys(
    faulty_tier_type: str,
) -> None:
    """A load whose later windows start after close() began must not raise out of the
    cache nor leave flights (or the promotion count) behind for a reopened cache."""
    cache = TieredCache(parse_config(chain([{"type": "faulty"}], close_timeout=5)))
    await cache.open()
    tier = cache.tier("faulty")
    assert isinstance(tier, FaultyTier)
    ks, blocks = keys(16), data(16)
    assert (await cache.store(ks, blocks)).ok
    await cache.flush()
    assert (await cache.store(keys(8, "filler"), data(8, 1))).ok  # push ks out
    await cache.flush()
    assert not any(k in cache.primary for k in ks)
    tier.gate = anyio.Event()
    out = torch.zeros(16, BLOCK, dtype=torch.uint8)
    results: list[Any] = []

    async def load() -> None:
        try:
            results.append(await cache.load(ks, out))
        except Exception as exc:  # the defect: TierUnavailable out of a running load
            results.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        assert cache.core.index.promoting > 0  # the first windows wait on the tier
        tg.start_soon(cache.close)
        await anyio.wait_all_tasks_blocked()
        tier.gate.set()
    (result,) = results
    assert not isinstance(result, Exception), result
    ok = set(result.ok_keys)
    assert ok | set(result.failed_keys) == set(ks)
    for i, k in enumerate(ks):
        if k in ok:
            assert torch.equal(out[i], blocks[i])
    assert_idle(cache)
    await cache.open()  # a reopened cache must not wait on flights of the old one
    try:
        tier.gate = None
        assert all(cache.core.index.flight(k) is None for k in ks)
        with anyio.fail_after(5):
            again = await cache.load(ks, torch.zeros(16, BLOCK, dtype=torch.uint8))
        assert set(again.ok_keys) | set(again.failed_keys) == set(ks)
        assert_idle(cache)
    finally:
        await cache.close()


async def test_a_block_the_tier_evicts_before_its_store_is_answered_is_not_believed_held(
    tmp_path: Path,
) -> None:
    """nvme with room for a few blocks, several cascades at once: a block evicted by
    one job (reported removed) while the job that stored it is still running was then
    emitted as `stored` after its `removed` event and believed held by the index."""
    nvme = {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": 6 * 4096}
    async with TieredCache(parse_config(chain([{**nvme, "fsync": "never"}], blocks=16))) as cache:
        tier = cache.tier("nvme")
        ks = keys(64)
        for w in range(16):
            await cache.store(ks[4 * w : 4 * w + 4], data(4, w))
        await cache.flush()
        held_by_events: dict[OffloadKey, bool] = {}
        for event in cache.take_events():
            if event.medium == "nvme":
                for key in event.keys:
                    held_by_events[key] = not event.removed
        really = {k for k in ks if k in tier._index}  # type: ignore[attr-defined]
        assert {k for k, held in held_by_events.items() if held} == really
        assert {k for k in ks if cache.core.index.held(k) & 1} == really


async def test_gpu_blocks_whose_worker_copies_into_another_cache_are_refused_first() -> None:
    """A `KVCacheBlocks` over a worker built for another cache's slab of the same shape
    passed the shape check, so a store copied the GPU bytes into the other slab and
    this cache then served its own uninitialised slot as the block."""
    from tierkv.gpu import TransferWorker, required_block_bytes
    from tierkv.gpu.kv_blocks import KVCacheBlocks

    kv = [[torch.arange(8 * 64, dtype=torch.float16).reshape(8, 64)]]
    block_bytes = required_block_bytes(kv, 1)
    config = parse_config(
        {
            "namespace": "gpu",
            "layout": {"block_bytes": block_bytes, "groups": [{"block_size": 16}]},
            "primary": {"capacity": 2 * block_bytes, "pin_memory": False},
            "tiers": [],
        }
    )
    async with TieredCache(config) as other, TieredCache(config) as cache:
        foreign = TransferWorker(kv, other.primary.view, config.layout, gpu_block_size=16)
        resident = keys(2, "resident")
        assert (await cache.store(resident, data(2)[:, :block_bytes])).ok
        cache.take_events()
        with pytest.raises(ValueError, match="another primary slab"):
            await cache.store(keys(1, "new"), KVCacheBlocks(foreign, [[3]]))
        with pytest.raises(ValueError, match="another primary slab"):
            await cache.load(resident[:1], KVCacheBlocks(foreign, [[5]]))
        assert set(cache.primary.keys_in_slots()) == set(resident)  # nothing evicted
        assert cache.take_events() == []
        assert_idle(cache)


@pytest.mark.parametrize("seed", range(3))
async def test_cancelled_stores_and_loads_leak_no_slot_and_serve_no_wrong_byte(
    tmp_path: Path, faulty_tier_type: str, seed: int
) -> None:
    """Many tasks store and load overlapping prefixes through a small primary over a slow
    tier and a real nvme tier, each call cancelled at a random moment: once idle, every
    slot is free or evictable and what loads is byte-identical."""
    import random

    rng = random.Random(seed)
    tiers = [
        {"type": "faulty", "delay": 0.002, "write_policy": "write_through"},
        {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB", "fsync": "never"},
    ]
    family = keys(24)
    blocks = data(24, seed)
    async with TieredCache(parse_config(chain(tiers, blocks=8, store_timeout=0.05))) as cache:

        async def client(n: int) -> None:
            r = random.Random(rng.random())
            for _ in range(12):
                end = r.randint(1, 24)
                with anyio.move_on_after(r.choice([0, 0.001, 0.003, 0.01, 1])):
                    if r.random() < 0.5:
                        await cache.store(family[:end], blocks[:end])
                    else:
                        out = torch.zeros(end, BLOCK, dtype=torch.uint8)
                        result = await cache.load(family[:end], out)
                        for i, key in enumerate(family[:end]):
                            if key in result.ok_keys:
                                assert torch.equal(out[i], blocks[i])

        async with anyio.create_task_group() as tg:
            for n in range(12):
                tg.start_soon(client, n)
        await cache.flush()
        assert_idle(cache)
        assert all(cache.core.index.flight(k) is None for k in family)


async def test_a_store_waiting_on_a_hung_write_back_tier_keeps_its_store_timeout(
    faulty_tier_type: str,
) -> None:
    """A store that needs the room of dirty blocks wrote them back on its own path
    without a deadline, so a write-back tier that hangs (breaker still closed) held the
    store for the tier's whole job_timeout, far past store_timeout."""
    tiers = [{"type": "faulty", "write_policy": "write_back", "job_timeout": "1h"}]
    config = chain(tiers, blocks=8, store_timeout=0.1, write_back_max_dirty=1.0)
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.hang = True
        assert (await cache.store(keys(8), data(8))).ok  # the primary is full of dirty blocks
        with anyio.fail_after(20):  # store_timeout is 0.1 s; the tier answers in an hour
            result = await cache.store(keys(4, "more"), data(4, 1))
        assert result.rejected and result.error
        assert set(cache.primary.keys_in_slots()) == set(keys(8))  # dirty blocks are never dropped
        tier.hang = False


async def test_nvme_losing_its_directory_mid_run_falls_back_to_redis_byte_identical(
    tmp_path: Path, redis_url: str
) -> None:
    """A primary much smaller than the data, nvme above redis: the nvme directory
    vanishes mid-run (every read and write now fails). Loads fall back to redis and are
    byte-identical; stores keep streaming into redis; nothing is leaked."""
    import shutil

    tiers = [
        {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB", "fsync": "never"},
        {"type": "redis", "url": redis_url},
    ]
    async with TieredCache(parse_config(chain(tiers, blocks=8))) as cache:
        ks, blocks = keys(32), data(32)
        assert (await cache.store(ks, blocks)).ok
        await cache.flush()
        shutil.rmtree(tmp_path / "nvme")
        out = torch.zeros(32, BLOCK, dtype=torch.uint8)
        result = await cache.load(ks, out)
        assert set(result.ok_keys) | set(result.failed_keys) == set(ks)
        for i, key in enumerate(ks):
            if key in result.ok_keys:
                assert torch.equal(out[i], blocks[i])
        assert {result.sources[k] for k in result.ok_keys} <= {"cpu", "redis"}
        assert len(result.failed_keys) == 0  # redis holds every block
        more, more_blocks = keys(32, "more"), data(32, 1)
        stored = await cache.store(more, more_blocks)
        assert stored.ok
        await cache.flush()
        hit = await cache.lookup([more])
        out = torch.zeros(len(hit.keys_to_load), BLOCK, dtype=torch.uint8)
        result = await cache.load(hit.keys_to_load, out)
        assert hit.hit_tokens == 32 * 16 and result.ok
        assert torch.equal(out, more_blocks)
        await cache.flush()
        assert_idle(cache)


async def test_close_writes_dirty_blocks_back_and_a_new_cache_serves_them(tmp_path: Path) -> None:
    """Write-back blocks that never had to leave the primary reach the tier at close()."""
    tiers = [
        {
            "type": "nvme",
            "path": str(tmp_path / "nvme"),
            "capacity": "1MiB",
            "fsync": "never",
            "write_policy": "write_back",
        }
    ]
    ks, blocks = keys(4), data(4)
    async with TieredCache(parse_config(chain(tiers, blocks=8))) as cache:
        assert (await cache.store(ks, blocks)).ok
        assert cache.stats().primary["write_back_pending"] == 4
    async with TieredCache(parse_config(chain(tiers, blocks=8))) as cache:
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 4 * 16
        out = torch.zeros(4, BLOCK, dtype=torch.uint8)
        assert (await cache.load(ks, out)).ok
        assert torch.equal(out, blocks)


async def test_a_tier_answering_one_key_twice_and_another_not_at_all_is_held_to_once(
    faulty_tier_type: str,
) -> None:
    """The guard holds a tier to 'every key exactly once': a store answer naming one key
    twice and leaving another out passed as complete, so the event named the key
    twice and the forgotten key got no reason."""
    from tierkv.contract.jobs import JobMetadata, JobResult

    async with TieredCache(parse_config(chain([{"type": "faulty"}], blocks=8))) as cache:
        tier = cache.tier("faulty")

        async def store(job: JobMetadata) -> JobResult:
            return JobResult(job.job_id, (job.keys[0], job.keys[0]), ())

        tier.store = store  # type: ignore[method-assign]
        ks = keys(2)
        cache.take_events()
        assert (await cache.store(ks, data(2))).ok
        await cache.flush()
        tier_events = [e for e in cache.take_events() if e.medium == "faulty"]
        assert [e.keys for e in tier_events] == [(ks[0],)]
        stats = cache.stats().tiers["faulty"]
        assert stats["blocks_stored"] == 1 and stats["failed_keys"] == 1
        assert cache.core.index.held(ks[1]) == 0


async def test_close_counts_dirty_blocks_it_could_not_write_back(faulty_tier_type: str) -> None:
    """close() with a write-back tier down left its dirty blocks unwritten and uncounted:
    they vanished with the primary, with no `write_back_dropped` and no warning."""
    tiers = [{"type": "faulty", "write_policy": "write_back", "recovery_after": "1h"}]
    cache = TieredCache(parse_config(chain(tiers, blocks=8, close_timeout=1)))
    async with cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.down = True
        assert (await cache.store(keys(4), data(4))).ok
        assert cache.stats().primary["write_back_pending"] == 4
    stats = cache.stats()
    assert stats.primary["write_back_pending"] == 0
    assert stats.primary["write_back_dropped"] == 4
    assert stats.tiers["faulty"]["drops"] == 4


async def test_a_block_the_upper_tier_lost_is_still_a_hit_in_the_tier_below(
    tmp_path: Path, redis_url: str
) -> None:
    """redis above nvme, both hold a prefix; redis restarts empty (it reports nothing).
    Lookup asked only redis (the index placed the keys there) and reported a miss
    although nvme, healthy, holds every block."""
    from tierkv_redis.testing import RedisServer

    (tmp_path / "redis").mkdir()
    with RedisServer(tmp_path / "redis") as server:
        tiers = [
            {"type": "redis", "url": server.url},
            {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB", "fsync": "never"},
        ]
        async with TieredCache(parse_config(chain(tiers, blocks=8))) as cache:
            ks, blocks = keys(16), data(16)
            assert (await cache.store(ks, blocks)).ok
            await cache.flush()
            assert (await cache.store(keys(8, "filler"), data(8, 1))).ok
            await cache.flush()
            assert not any(k in cache.primary for k in ks)
            server.stop()
            server.start()  # empty: nothing is persisted
            hit = await cache.lookup([ks])
            assert hit.hit_tokens == 16 * 16
            assert set(hit.locations.values()) == {"nvme"}
            out = torch.zeros(16, BLOCK, dtype=torch.uint8)
            result = await cache.load(hit.keys_to_load, out)
            assert result.ok and torch.equal(out, blocks)
            assert_idle(cache)


async def test_a_write_back_tier_whose_probe_hangs_does_not_stop_caching(
    faulty_tier_type: str,
) -> None:
    """The soak's redis outage: the breaker half-open with its one probe in flight
    (hanging). Half-open counted as healthy, so every stored block became dirty, none
    could be written or dropped, and once the primary was all dirty stores were
    rejected (soak: 173 blocks rejected while redis was down)."""
    tiers = [{"type": "faulty", "write_policy": "write_back", "recovery_after": 0.01}]
    config = chain(tiers, blocks=16, store_timeout=0.2)
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.down = True
        i = 0
        while cache.stats().tiers["faulty"]["breaker"] != "open":
            await cache.store(keys(4, f"wb{i}"), data(4, i))
            await cache.flush()
            i += 1
        await anyio.sleep(0.05)  # half-open: the next write-back is the probe, and hangs
        tier.down, tier.gate = False, anyio.Event()
        rejected = 0
        for j in range(i, i + 12):
            result = await cache.store(keys(4, f"wb{j}"), data(4, j))
            rejected += len(result.rejected)
        assert rejected == 0
        assert cache.stats().primary["write_back_pending"] <= 8 + 4
        tier.gate.set()


class _GatedDestination:
    """A load destination whose copy waits for `gate` (a load in progress)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.gate = anyio.Event()

    def __len__(self) -> int:
        return self.count

    async def copy_from_slots(self, view: Any, indices: Any, slots: Any) -> None:
        await self.gate.wait()


async def test_a_store_that_found_no_room_rechecks_after_writing_back(
    faulty_tier_type: str, tmp_path: Path
) -> None:
    """Soak with redis as a write-back tier, killed: a store found no room (dirty blocks
    and blocks read by loads), wrote back (awaiting the tier), and meanwhile the loads
    finished; it then judged 'nothing in flight can make room' on the stale state and
    rejected blocks although clean evictable slots were there (soak: 156 blocks)."""
    tiers = [
        {"type": "faulty", "write_policy": "write_back", "recovery_after": "1h"},
        {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB", "fsync": "never"},
    ]
    async with TieredCache(parse_config(chain(tiers, blocks=8))) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        read = keys(4, "read")
        assert (await cache.store(read, data(4))).ok
        await cache.flush()
        for k in read:  # written back: clean
            assert cache.core.index.is_clean(k)
        tier.down = True
        i = 0
        while cache.stats().tiers["faulty"]["breaker"] != "open":  # failed lookups open it
            await cache.lookup([keys(1, f"x{i}")])
            i += 1
        dirty = keys(4, "dirty")
        assert (await cache.store(dirty, data(4, 9))).ok
        resident = set(cache.primary.keys_in_slots())
        assert len(resident) == 8 and set(read) <= resident
        assert all(cache.core.index.is_dirty(k) for k in resident - set(read))
        dest = _GatedDestination(4)
        make_room = cache.writeback.make_room

        async def make_room_while_loads_finish(wanted: int) -> bool:
            dest.gate.set()  # the load finishes while the write-back runs
            await anyio.wait_all_tasks_blocked()
            return await make_room(wanted)

        cache.writeback.make_room = make_room_while_loads_finish  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.load, read, dest)
            await anyio.wait_all_tasks_blocked()
            assert all(cache.primary.readers(k) == 1 for k in read)
            result = await cache.store(keys(4, "new"), data(4, 5))
        assert result.ok, result.error
