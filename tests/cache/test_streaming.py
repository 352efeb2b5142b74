"""Issue 10: the primary is a staging area, not a ceiling.

Chain `primary 32MiB + nvme` with 1 MiB blocks (a real nvme tier on real files):
stores larger than the primary stream through it, lookups report the true hit, loads
promote in windows. Plus: a write-back tier that is down does not stop caching, bad
GPU block ids change nothing, lookups send no job to a tier found lacking a key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

MIB = 1 << 20


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, block: int = MIB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=g)


def nvme_chain(tmp_path: Path, **top: Any) -> dict[str, Any]:
    return {
        "namespace": "stream",
        "layout": {"block_bytes": MIB, "groups": [{"block_size": 16}]},
        "primary": {"capacity": "32MiB", "pin_memory": False},
        "tiers": [
            {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1GiB", "fsync": "never"}
        ],
        **top,
    }


@asynccontextmanager
async def opened(config: dict[str, Any]) -> AsyncIterator[TieredCache]:
    async with TieredCache(parse_config(config)) as cache:
        yield cache
        await cache.flush()
        p = cache.primary
        assert all(p.readers(k) == 0 and p.is_ready(k) for k in p.keys_in_slots())
        assert cache.core.index.promoting == 0


async def push_out(cache: TieredCache, n: int = 32) -> None:
    """Store unrelated blocks until nothing stored before is left in the primary."""
    await cache.flush()
    result = await cache.store(keys(n, "filler"), data(n, seed=99))
    assert result.ok
    await cache.flush()


async def test_a_48_block_store_into_a_32_block_primary_is_wholly_stored(tmp_path: Path) -> None:
    async with opened(nvme_chain(tmp_path)) as cache:
        ks, blocks = keys(48), data(48)
        result = await cache.store(ks, blocks)
        assert result.ok and result.stored == tuple(ks) and not result.rejected
        await cache.flush()
        assert len(cache.tier("nvme")) == 48  # type: ignore[arg-type]
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 48 * 16 and hit.keys_to_load == tuple(ks)
        out = torch.zeros_like(blocks)
        loaded = await cache.load(hit.keys_to_load, out)
        assert loaded.ok and torch.equal(out, blocks)
        assert set(loaded.sources.values()) == {"cpu", "nvme"}


async def test_a_24_block_prefix_only_in_nvme_loads_24(tmp_path: Path) -> None:
    async with opened(nvme_chain(tmp_path)) as cache:  # promotion reserve: 16 slots
        ks, blocks = keys(24), data(24, seed=1)
        assert (await cache.store(ks, blocks)).ok
        await push_out(cache)
        assert not any(k in cache.primary for k in ks)
        hit = await cache.lookup([ks])
        assert hit.hit_tokens == 24 * 16 and set(hit.locations.values()) == {"nvme"}
        out = torch.zeros_like(blocks)
        loaded = await cache.load(hit.keys_to_load, out)
        assert loaded.ok and len(loaded.ok_keys) == 24 and torch.equal(out, blocks)
        assert set(loaded.sources.values()) == {"nvme"}
        # two windows of 8 (half the reserve), overlapped: two nvme load jobs
        assert cache.stats().tiers["nvme"]["load_jobs"] >= 2


async def test_back_to_back_stores_without_flush_lose_nothing(tmp_path: Path) -> None:
    async with opened(nvme_chain(tmp_path)) as cache:
        everything = keys(80, "b2b")
        blocks = data(80, seed=2)
        for i in range(10):
            chunk = slice(8 * i, 8 * i + 8)
            result = await cache.store(everything[chunk], blocks[chunk])
            assert result.ok and len(result.stored) == 8, result.error
        await cache.flush()
        nvme = cache.tier("nvme")
        held = await nvme.lookup(everything, None)  # type: ignore[arg-type]
        assert all(held[i] or everything[i] in cache.primary for i in range(80))
        hit = await cache.lookup([everything])
        assert hit.hit_tokens == 80 * 16
        out = torch.zeros_like(blocks)
        assert (await cache.load(everything, out)).ok and torch.equal(out, blocks)


async def test_without_a_secondary_tier_the_fitting_prefix_is_stored_and_the_rest_rejected() -> (
    None
):
    config = {
        "namespace": "alone",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 8 * 1024, "pin_memory": False},
    }
    async with opened(config) as cache:
        ks = keys(12)
        with anyio.fail_after(1):  # at once, no waiting
            result = await cache.store(ks, data(12, 1024))
        assert result.stored == tuple(ks[:8]) and result.rejected == tuple(ks[8:])
        assert result.error and "no room" in result.error
        assert cache.stats().primary["store_rejected"] == 4


async def test_concurrent_streaming_stores_and_loads_stay_byte_identical(tmp_path: Path) -> None:
    async with opened(nvme_chain(tmp_path)) as cache:
        requests = [(keys(20, f"r{i}"), data(20, seed=10 + i)) for i in range(3)]
        async with anyio.create_task_group() as tg:
            for ks, blocks in requests:
                tg.start_soon(cache.store, ks, blocks)
        await cache.flush()
        outs = [torch.zeros_like(b) for _, b in requests]
        results: list[Any] = [None] * 3
        async with anyio.create_task_group() as tg:

            async def load(i: int) -> None:
                results[i] = await cache.load(requests[i][0], outs[i])

            for i in range(3):
                tg.start_soon(load, i)
        for (ks, blocks), out, result in zip(requests, outs, results):
            # under contention the reserve may shed a tail as misses; what loaded is right
            for j, key in enumerate(ks):
                if key in result.ok_keys:
                    assert torch.equal(out[j], blocks[j])
                else:
                    assert "load shed" in result.errors[key]


# -- write-back -----------------------------------------------------------------------------
async def test_a_write_back_tier_that_is_down_does_not_stop_caching(faulty_tier_type: str) -> None:
    config = {
        "namespace": "wb",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 16 * 1024, "pin_memory": False},
        "tiers": [{"type": "faulty", "write_policy": "write_back", "recovery_after": "1h"}],
    }
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.down = True
        for i in range(20):
            result = await cache.store(keys(4, f"wb{i}"), data(4, 1024, seed=i))
            assert result.ok, (i, result.error)
            hit = await cache.lookup([keys(4, f"wb{i}")])
            assert hit.hit_tokens == 64  # just stored: served from the primary
        await cache.flush()
        stats = cache.stats()
        assert stats.tiers["faulty"]["breaker"] == "open"
        assert stats.primary["write_back_dropped"] > 0
        assert stats.primary["write_back_pending"] <= 8  # the dirty bound: half the primary
        tier.down = False


async def test_write_back_follows_the_eviction_order(faulty_tier_type: str) -> None:
    config = {
        "namespace": "wb2",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 8 * 1024, "pin_memory": False},
        "tiers": [{"type": "faulty", "write_policy": "write_back"}],
        "write_back_headroom": 0,
        "write_back_max_dirty": 1.0,
    }
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        first, second = keys(4, "a"), keys(4, "b")
        await cache.store(first, data(4, 1024))
        await cache.store(second, data(4, 1024, seed=1))
        await cache.lookup([first])  # first is now the most recently used
        assert tier.calls == []  # no pressure, nothing written
        result = await cache.store(keys(2, "c"), data(2, 1024, seed=2))
        assert result.ok  # room made by writing back the policy's victims
        # the write-back that made the room (the first): LRU victims, not store order
        # (the dirty bound's own writer may follow, oldest dirty first)
        written = next(ks for op, ks in tier.calls if op == "store")
        assert set(written) <= set(second) and written
        assert all(k in cache.primary for k in first)


# -- validation before mutation ------------------------------------------------------------
async def test_bad_gpu_block_ids_change_nothing() -> None:
    from tierkv.gpu import TransferWorker, required_block_bytes
    from tierkv.gpu.kv_blocks import KVCacheBlocks

    kv = [[torch.zeros(8, 64, dtype=torch.float16)]]
    block_bytes = required_block_bytes(kv, 1)
    config = parse_config(
        {
            "namespace": "gpu",
            "layout": {"block_bytes": block_bytes, "groups": [{"block_size": 16}]},
            "primary": {"capacity": 4 * block_bytes, "pin_memory": False},
            "tiers": [{"type": "memory"}],
        }
    )
    async with TieredCache(config) as cache:
        worker = TransferWorker(kv, cache.primary.view, config.layout, gpu_block_size=16)
        resident = keys(4, "resident")
        assert (await cache.store(resident, KVCacheBlocks(worker, [[0, 1, 2, 3]]))).ok
        await cache.flush()
        cache.take_events()
        with pytest.raises(ValueError, match=r"GPU block ids \[99\] are out of range 0..7"):
            await cache.store(keys(2, "new"), KVCacheBlocks(worker, [[4, 99]]))
        with pytest.raises(ValueError, match="out of range"):
            await cache.load(keys(2, "new"), KVCacheBlocks(worker, [[-1, 5]]))
        assert set(cache.primary.keys_in_slots()) == set(resident)  # nothing evicted
        assert cache.take_events() == []  # no event
        assert cache.stats().tiers["memory"]["load_jobs"] == 0  # nothing promoted


# -- lookup ---------------------------------------------------------------------------------
async def test_lookup_skips_tokens_the_gpu_holds_and_asks_each_tier_once(
    faulty_tier_type: str,
) -> None:
    config = {
        "namespace": "lk",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 8 * 1024, "pin_memory": False},
        "tiers": [{"type": "faulty"}, {"type": "memory"}],
    }
    async with TieredCache(parse_config(config)) as cache:
        ks = keys(6)
        await cache.store(ks, data(6, 1024))
        await cache.flush()
        await cache.store(keys(8, "filler"), data(8, 1024, seed=3))
        await cache.flush()
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        tier.calls.clear()
        hit = await cache.lookup([ks], gpu_tokens=40)  # 2 whole blocks on the GPU
        assert hit.hit_tokens == 96 and hit.keys_to_load == tuple(ks[2:])
        assert tier.calls == [("lookup", tuple(ks[2:]))]  # once, only about the rest
        with pytest.raises(ValueError, match="gpu_tokens must be a non-negative int"):
            await cache.lookup([ks], gpu_tokens=-1)


async def test_selective_write_through_counts_hits_per_request() -> None:
    from tierkv.contract.jobs import ReqContext

    config = {
        "namespace": "sel",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 8 * 1024, "pin_memory": False},
        "tiers": [{"type": "memory", "write_policy": "write_through_selective", "min_hits": 2}],
    }
    async with TieredCache(parse_config(config)) as cache:
        ks = keys(3)
        await cache.store(ks, data(3, 1024))
        one = ReqContext(request_id="one")
        for _ in range(5):  # one request polling its lookup is one hit
            await cache.lookup([ks], one)
        await cache.flush()
        assert len(cache.tier("memory")) == 0  # type: ignore[arg-type]
        await cache.lookup([ks], ReqContext(request_id="two"))
        await cache.flush()
        assert len(cache.tier("memory")) == 3  # type: ignore[arg-type]
        assert cache.stats().tiers["memory"]["store_jobs"] == 1  # one batch


async def test_a_tier_reporting_a_removal_updates_the_index_and_emits_an_event() -> None:
    config = {
        "namespace": "rm",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 4 * 1024, "pin_memory": False},
        "tiers": [{"type": "memory"}],
    }
    async with TieredCache(parse_config(config)) as cache:
        ks = keys(2)
        await cache.store(ks, data(2, 1024))
        await cache.flush()
        assert cache.index.location(ks[0]) == 0
        cache.take_events()
        tier = cache.tier("memory")
        await tier.remove([ks[0]])
        tier.report_removed([ks[0]])
        assert cache.index.location(ks[0]) is None
        assert cache.take_events() == [OffloadingEvent((ks[0],), "memory", removed=True)]


async def test_tiers_holding_parts_of_one_request_are_read_concurrently(
    faulty_tier_type: str,
) -> None:
    config = {
        "namespace": "split",
        "layout": {"block_bytes": 1024, "groups": [{"block_size": 16}]},
        "primary": {"capacity": 8 * 1024, "pin_memory": False},
        "tiers": [
            {"type": "faulty", "write_policy": "write_through_selective", "min_hits": 99},
            {"type": "memory"},
        ],
        "promotion_reserve": 1.0,
    }
    async with TieredCache(parse_config(config)) as cache:
        ks, blocks = keys(4), data(4, 1024, seed=7)
        await cache.store(ks, blocks)
        await cache.flush()
        faulty = cache.tier("faulty")
        assert isinstance(faulty, FaultyTier)
        for k in ks[:2]:  # the faulty tier (first in the chain) holds the first half
            await faulty.store(_direct_job(cache, [k]))
        await cache.store(keys(8, "filler"), data(8, 1024, seed=8))
        await cache.flush()
        await cache.tier("memory").remove(ks[:2])
        hit = await cache.lookup([ks])
        assert [hit.locations[k] for k in ks] == ["faulty", "faulty", "memory", "memory"]
        faulty.gate = anyio.Event()
        out = torch.zeros_like(blocks)
        result: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def load() -> None:
                result.append(await cache.load(ks, out))

            tg.start_soon(load)
            with anyio.fail_after(2):  # the memory tier's job runs while faulty's waits
                while cache.stats().tiers["memory"]["load_jobs"] == 0:
                    await anyio.sleep(0.005)
            assert cache.stats().tiers["faulty"]["load_jobs"] == 0
            faulty.gate.set()
        assert result[0].ok and dict(result[0].sources) == dict(hit.locations)
        assert torch.equal(out, blocks)


def _direct_job(cache: TieredCache, ks: list[OffloadKey]) -> Any:
    """A job storing the bytes of `ks` from their primary slots straight into a tier."""
    from tierkv.contract.jobs import JobMetadata

    slots = [cache.primary.slot_of(k) for k in ks]
    return JobMetadata(50_000 + len(ks), tuple(ks), tuple(s for s in slots if s is not None))
