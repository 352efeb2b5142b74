"""Loads and stores against their deadlines (issue 50 item 5): a tier job stuck in a
worker thread past its backstop is left running, its keys failed at once; the slots
it may still write (a load) or read (a store) stay held until it ends, so a late
write lands nowhere anyone reads."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.driver.checks import backstop_after
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 4096
JOB_TIMEOUT = 0.2


def keys(n: int, salt: str) -> list[OffloadKey]:
    hashes = hash_token_blocks(list(range(16 * n)), 16, namespace=f"abandon|{salt}")
    return [make_offload_key(h, 0) for h in hashes]


def blocks(n: int, fill: int) -> torch.Tensor:
    return torch.full((n, BLOCK), fill, dtype=torch.uint8)


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await anyio.sleep(0.01)


@asynccontextmanager
async def stuck_chain(
    tier_type: str, extra: str = "", primary: str = "32KiB"
) -> AsyncIterator[tuple[TieredCache, FaultyTier, threading.Event]]:
    """A cache over one faulty tier, and the event its stuck jobs wait on: always set
    on the way out, so no worker thread outlives the test."""
    release = threading.Event()
    config = parse_config(f"""
namespace: abandon
layout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}
primary: {{capacity: {primary}, pin_memory: false}}
tiers: [{{type: {tier_type}, capacity: 1MiB, job_timeout: {JOB_TIMEOUT}s{extra}}}]
""")
    try:
        async with TieredCache(config) as cache:
            tier = cache.tier(tier_type)
            assert isinstance(tier, FaultyTier)
            yield cache, tier, release
            release.set()
    finally:
        release.set()


async def test_a_stuck_load_is_left_behind_and_its_slots_held(faulty_tier_type: str) -> None:
    ka, kb, kc = keys(4, "a"), keys(8, "b"), keys(4, "c")
    async with stuck_chain(faulty_tier_type) as (cache, tier, release):
        await cache.store(ka, blocks(4, 1))
        await cache.flush()
        await cache.store(kb, blocks(8, 2))  # a's blocks leave the primary
        await cache.flush()
        assert not any(k in cache.primary for k in ka)
        hit = await cache.lookup([ka], ReqContext("r1"))
        assert len(hit.keys_to_load) == 4
        tier.stuck = release
        started = time.monotonic()
        loaded = await cache.load(hit.keys_to_load, blocks(4, 0), ReqContext("r1"))
        assert time.monotonic() - started < backstop_after(JOB_TIMEOUT) + 1.0
        assert not loaded.ok and set(loaded.failed_keys) == set(ka)
        assert cache.primary.num_quarantined == 4
        assert not any(k in cache.primary for k in ka)
        assert cache.stats().tiers[faulty_tier_type]["abandoned_jobs"] == 1
        # the primary goes on without those four slots
        tier.stuck = None
        result = await cache.store(kc, blocks(4, 3))
        assert result.error is None and len(result.stored) == 4
        assert len(cache.primary) + cache.primary.num_quarantined <= 8
        # the thread returns and writes 0xEE over its slots, late: they are freed
        release.set()
        await wait_for(lambda: cache.primary.num_quarantined == 0)
        for ks, fill in ((kc, 3), (kb[4:], 2)):  # resident blocks: none took a late byte
            resident = [k for k in ks if k in cache.primary]
            out = blocks(len(resident), 0)
            again = await cache.load(resident, out, ReqContext("r2"))
            assert again.ok and bool((out == fill).all())
        # and a's blocks load again from the tier, whole
        hit = await cache.lookup([ka], ReqContext("r3"))
        out = blocks(len(hit.keys_to_load), 0)
        again = await cache.load(hit.keys_to_load, out, ReqContext("r3"))
        assert again.ok and bool((out == 1).all())


async def test_a_stuck_store_keeps_its_blocks_read_until_it_ends(faulty_tier_type: str) -> None:
    kd = keys(3, "d")
    async with stuck_chain(faulty_tier_type) as (cache, tier, release):
        tier.stuck = release
        started = time.monotonic()
        await cache.store(kd, blocks(3, 4))
        await cache.flush()  # the cascade is left behind at its backstop
        assert time.monotonic() - started < backstop_after(JOB_TIMEOUT) + 1.0
        assert all(cache.primary.readers(k) == 1 for k in kd)  # still the tier's to read
        assert cache.stats().tiers[faulty_tier_type]["abandoned_jobs"] == 1
        tier.stuck = None
        release.set()
        await wait_for(lambda: all(cache.primary.readers(k) == 0 for k in kd))
        assert cache.primary.num_evictable == 3


async def test_past_the_limit_a_side_is_not_sent_more(faulty_tier_type: str) -> None:
    """MAX_ABANDONED_JOBS stores stuck: the next cascade is refused at once, unsent
    (the breaker would open first at its default threshold: raised here)."""
    from tierkv.driver.guarded import MAX_ABANDONED_JOBS

    extra = ", failure_threshold: 10"
    async with stuck_chain(faulty_tier_type, extra, "64KiB") as (cache, tier, release):
        tier.stuck = release
        for i in range(MAX_ABANDONED_JOBS):
            await cache.store(keys(1, f"s{i}"), blocks(1, 5))
            await cache.flush()
        calls = len(tier.calls)
        await cache.store(keys(1, "last"), blocks(1, 5))
        await cache.flush()
        stats = cache.stats().tiers[faulty_tier_type]
        assert stats["abandoned_jobs"] == MAX_ABANDONED_JOBS
        assert len(tier.calls) == calls  # not sent
        assert stats["skipped_unhealthy"] >= 1
        tier.stuck = None
        release.set()


async def test_a_stuck_write_back_keeps_its_block_dirty_and_read(faulty_tier_type: str) -> None:
    """A write-back job left running at its deadline: the block stays dirty (it is
    owed to the tier still) and read until the job ends; then it is evictable."""
    kw = keys(2, "w")
    back = ", write_policy: write_back"
    async with stuck_chain(faulty_tier_type, back) as (cache, tier, release):
        tier.stuck = release
        await cache.store(kw, blocks(2, 6))
        started = time.monotonic()
        await cache.flush()  # offers the dirty blocks: the job is left behind
        assert time.monotonic() - started < 2 * backstop_after(JOB_TIMEOUT) + 1.0
        assert all(cache.index.is_dirty(k) for k in kw)
        assert all(cache.primary.readers(k) == 1 for k in kw)
        assert cache.stats().tiers[faulty_tier_type]["abandoned_jobs"] >= 1
        tier.stuck = None
        release.set()
        await wait_for(lambda: all(cache.primary.readers(k) == 0 for k in kw))
        await cache.flush()  # offered again: written now
        assert all(cache.index.is_clean(k) for k in kw)
