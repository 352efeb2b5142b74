"""A job moves in lanes, one thread call each going through its batches, and keeps what
one call per batch promised: its deadline and a cancellation end it after the batch in
flight (keys done before it are reported done, the rest failed), and a long job gives
its thread to another call of the tier after one batch.

The client's batched calls are slowed (`SLOW` seconds each) to make the timing plain."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from tierkv_mooncake import MooncakeTier, MooncakeTierConfig
from tierkv_mooncake.testing import MooncakeMaster

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.testing import fill_slots, random_keys

pytestmark = pytest.mark.anyio

CTX = ReqContext(request_id="mooncake-lanes")
BLOCK = 16 << 10
SLOW = 0.15
_job_ids = itertools.count(1)
spans: list[tuple[float, float]] = []


def job(keys: list[OffloadKey], slots: list[int] | range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


@asynccontextmanager
async def stored(
    master: MooncakeMaster, blocks: int, **fields: Any
) -> AsyncIterator[tuple[MooncakeTier, PrimaryView, list[OffloadKey], list[float]]]:
    """A tier (`batch_blocks` 2, one thread unless told) holding `blocks` blocks from
    slots 0.., its gets and puts then slowed; the list collects when each call began
    (and `spans`, when each began and ended)."""
    view = PrimaryView(bytearray(2 * blocks * BLOCK), BLOCK, "lanes")
    config = MooncakeTierConfig.model_validate(
        {
            "master": master.master,
            "metadata_server": master.metadata_server,
            "key_prefix": f"l{random.getrandbits(48):x}/",
            "batch_blocks": 2,
            "concurrency": 1,
            **fields,
        }
    )
    tier = MooncakeTier(config, view)
    await tier.open()
    try:
        keys = random_keys(blocks, random.Random(blocks))
        fill_slots(view, range(blocks), random.Random(7))
        assert (await tier.store(job(keys, range(blocks)))).ok
        client = tier._client
        assert client is not None
        began: list[float] = []
        real_get, real_put = client.get_into, client.put

        def get_into(*args: Any) -> list[int]:
            began.append(time.monotonic())
            time.sleep(SLOW)
            codes = real_get(*args)
            spans.append((began[-1], time.monotonic()))
            return codes

        def put(*args: Any) -> list[int]:
            began.append(time.monotonic())
            time.sleep(SLOW)
            codes = real_put(*args)
            spans.append((began[-1], time.monotonic()))
            return codes

        client.get_into = get_into  # type: ignore[method-assign]
        client.put = put  # type: ignore[method-assign]
        yield tier, view, keys, began
        await tier.remove(keys)
    finally:
        await tier.close()


async def test_the_deadline_ends_a_lane_after_its_batch_in_flight(
    mooncake_store: MooncakeMaster,
) -> None:
    async with stored(mooncake_store, 16, job_timeout="0.5s") as (tier, view, keys, began):
        dest = list(range(16, 32))
        started = time.monotonic()
        result = await tier.load(job(keys, dest))
        elapsed = time.monotonic() - started
        assert elapsed < 0.5 + SLOW + 1.0, f"the load took {elapsed:.2f}s"
        done = set(result.ok_keys)
        assert 0 < len(done) < 16
        # the lane moves its batches in order: what is done is a prefix, reported done
        assert done == set(keys[: len(done)])
        assert len(done) == 2 * len(began)
        for k, s in zip(keys, dest):
            if k in done:
                assert bytes(view.block(s)) == bytes(view.block(keys.index(k)))
        assert result.error is not None and "job_timeout=0.5s" in result.error


async def test_a_cancelled_job_stops_after_its_batch_in_flight(
    mooncake_store: MooncakeMaster,
) -> None:
    async with stored(mooncake_store, 16) as (tier, _view, keys, began):
        started = time.monotonic()
        with anyio.move_on_after(0.3):
            await tier.load(job(keys, range(16, 32)))
        elapsed = time.monotonic() - started
        assert elapsed < 0.3 + SLOW + 1.0, f"the cancelled load took {elapsed:.2f}s"
        calls = len(began)
        assert calls < 8
        await anyio.sleep(2 * SLOW)
        assert len(began) == calls, "the lane's thread went on after its job was cancelled"


async def test_a_long_job_lets_a_lookup_through_after_one_batch(
    mooncake_store: MooncakeMaster,
) -> None:
    async with stored(mooncake_store, 24) as (tier, _view, keys, _began):
        results = []

        async def store_all() -> None:
            results.append(await tier.store(job(keys, range(24))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(store_all)  # 12 batches: ~1.8 s, holding the tier's one thread
            await anyio.sleep(SLOW)
            started = time.monotonic()
            assert await tier.lookup(keys[:4], CTX) == [True] * 4
            waited = time.monotonic() - started
        assert waited < SLOW + 0.5, f"the lookup waited {waited:.2f}s for the store"
        assert results[0].ok, results[0].error


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    return max(itertools.accumulate(step for _, step in edges))


async def test_lanes_share_a_job_and_report_every_key_once(
    mooncake_store: MooncakeMaster,
) -> None:
    async with stored(mooncake_store, 15, concurrency=3) as (tier, view, keys, began):
        spans.clear()
        dest = list(range(15, 30))
        result = await tier.load(job(keys, dest))
        assert result.ok, result.error
        assert sorted(result.ok_keys) == sorted(keys)
        assert len(began) == 8  # 15 blocks, 2 a batch
        assert most_at_once(spans) <= 3, "more batched calls in flight than `concurrency`"
        assert [bytes(view.block(s)) for s in dest] == [bytes(view.block(s)) for s in range(15)]
