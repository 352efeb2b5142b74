"""`names.py`: stored names and how a frame is cut into values. Fitted frames
(`fit_values`, frames of 256 KiB and up) put every full part ALLOC_SLACK short of one of
jemalloc's size classes and the rest in one small last part; against a real
redis-server a 1 MiB block's values then take about its own size (`MEMORY USAGE`),
where a whole value took a quarter more. Blocks stored by the other layout are misses, never
misread or deleted."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from tierkv_redis import RedisTier, RedisTierConfig
from tierkv_redis.config import MIN_PART_SIZE
from tierkv_redis.names import (
    ALLOC_SLACK,
    FIT_MAX_TAIL,
    FIT_MIN_FRAME,
    BlockNames,
    class_floor,
    fitted_lengths,
    size_class,
)
from tierkv_redis.testing import RedisServer

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.primary import PrimaryTier
from tierkv.testing import fill_slots, random_keys

MiB = 1 << 20
KEY = make_offload_key(bytes(range(16)), 3)
_job_ids = iter(range(1, 1 << 30))


def _job(keys: list[OffloadKey], slots: range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), ReqContext(request_id="n"))


# -- size classes ---------------------------------------------------------------------
def test_size_classes_are_four_per_power_of_two() -> None:
    assert [size_class(n) for n in (MiB, MiB + 1, MiB + 300_000, 2 * MiB - 1)] == [
        MiB,
        MiB + MiB // 4,
        MiB + MiB // 2,
        2 * MiB,
    ]
    assert size_class(8 * MiB + 12) == 10 * MiB
    assert class_floor(MiB - 1) == MiB - MiB // 8  # 896 KiB: the class below 1 MiB
    assert class_floor(5 * MiB + 7) == 5 * MiB


@given(st.integers(min_value=4096, max_value=1 << 40))
def test_a_size_class_is_the_least_class_at_or_above(length: int) -> None:
    up, down = size_class(length), class_floor(length)
    assert down <= length <= up
    assert up - length < max(1, length // 4) and length - down < max(1, length // 4)
    assert size_class(up) == up and class_floor(down) == down and size_class(down) == down


# -- layouts --------------------------------------------------------------------------
@pytest.mark.parametrize("block", [256 << 10, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 32 * MiB])
@pytest.mark.parametrize("mac", [False, True])
def test_power_of_two_blocks_are_fitted_with_a_small_last_part(block: int, mac: bool) -> None:
    names = BlockNames("tierkv:", "ns", block, 8 * MiB, mac=mac, fit=True)
    bounds = names.part_bounds(KEY)
    lengths = [end - start for start, end in bounds]
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert bounds[-1][1] == names.part_bounds(KEY)[-1][1]  # computed once, the same
    assert all(size_class(n + ALLOC_SLACK) == n + ALLOC_SLACK for n in lengths[:-1])
    assert 0 < lengths[-1] <= FIT_MAX_TAIL
    assert max(lengths) <= 8 * MiB
    # one part up to 4 MiB; 4 MiB parts past part_size (never a part of 8 MiB, whose
    # reads cost redis-server twice the CPU per MiB: the redis README)
    assert len(lengths) == {8 * MiB: 3, 32 * MiB: 9}.get(block, 2)
    stored = names.all(KEY)
    assert len(stored) == len(bounds) and len(set(stored)) == len(stored)
    assert stored[0].endswith(f":f{8 * MiB}") and stored[1].endswith(f":f{8 * MiB}:1")


def test_without_fitting_the_layout_and_names_are_the_earlier_ones() -> None:
    """`fit_values: false`: one value up to `part_size`, equal halves past it."""
    whole = BlockNames("tierkv:", "ns", MiB, 8 * MiB)
    assert len(whole.all(KEY)) == 1 and whole.all(KEY)[0].endswith("}")
    halves = BlockNames("tierkv:", "ns", 8 * MiB, 8 * MiB, fit=False)
    (a, b), (c, d) = halves.part_bounds(KEY)
    assert a == 0 and b == c and d - c <= b - a <= d - c + 1
    assert halves.all(KEY)[0].endswith(f":p{8 * MiB}")


def test_small_frames_and_frames_that_fit_already_are_not_fitted() -> None:
    small = BlockNames("tierkv:", "ns", 64 << 10, 8 * MiB, fit=True)
    assert len(small.all(KEY)) == 1  # under FIT_MIN_FRAME: one more command costs more
    assert fitted_lengths(FIT_MIN_FRAME - 1, 8 * MiB) is None
    assert fitted_lengths(MiB - ALLOC_SLACK, 8 * MiB) is None  # fits its class already
    # a cut that would leave a large last part keeps the earlier layout
    assert fitted_lengths(MiB + MiB // 8, 8 * MiB) is None


@given(
    block=st.integers(min_value=1, max_value=64 * MiB),
    part_size=st.integers(min_value=MIN_PART_SIZE, max_value=16 * MiB),
    fit=st.booleans(),
    mac=st.booleans(),
)
def test_parts_cover_the_frame_in_order_and_respect_part_size(
    block: int, part_size: int, fit: bool, mac: bool
) -> None:
    names = BlockNames("p:", "ns", block, part_size, mac=mac, fit=fit)
    bounds = names.part_bounds(KEY)
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(0 < end - start <= part_size for start, end in bounds)
    assert names.parts_of(KEY) == len(bounds) == len(names.all(KEY))
    assert names.split(KEY) == (bounds[-1][1] > part_size)


# -- against a real redis-server --------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("fit", [True, False])
async def test_fitted_blocks_take_their_own_size_of_redis_memory(
    redis_server: RedisServer, fit: bool
) -> None:
    """Blocks of 1 MiB: about 1.0x their size in Redis memory (`MEMORY USAGE` of
    each stored value) fitted, 1.25x whole (the measured figure that motivated fitting:
    it is Redis's allocator, not tierkv)."""
    client = redis.Redis(port=redis_server.port)
    if not str(client.info("memory").get("mem_allocator", "")).startswith("jemalloc"):
        pytest.skip("this redis-server does not allocate with jemalloc")
    rng = random.Random(5)
    view = PrimaryTier(8, MiB, pin_memory=False, namespace=f"fit-{os.urandom(3).hex()}").view
    config = {"url": redis_server.url, "fit_values": fit}
    tier = RedisTier(RedisTierConfig.model_validate(config), view)
    await tier.open()
    try:
        keys = random_keys(4, rng)
        data = fill_slots(view, range(4), rng)
        assert (await tier.store(_job(keys, range(4)))).ok
        names = [name for key in keys for name in tier._names.all(key)]
        used = sum(client.memory_usage(name, samples=0) or 0 for name in names)
        per_byte = used / (4 * MiB)
        if fit:
            assert per_byte < 1.01, per_byte
        else:
            assert per_byte > 1.2, per_byte
        assert (await tier.load(_job(keys, range(4, 8)))).ok
        assert all(bytes(view.block(4 + i)) == data[i] for i in range(4))
    finally:
        await tier.close()
        client.close()


@pytest.mark.anyio
async def test_blocks_of_the_other_layout_are_misses_and_stay(redis_server: RedisServer) -> None:
    """A server that fits and one that does not, sharing a namespace (an upgrade): each
    misses the other's blocks, reads no wrong byte and deletes nothing of them."""
    rng = random.Random(6)
    view = PrimaryTier(8, MiB, pin_memory=False, namespace=f"lay-{os.urandom(3).hex()}").view
    tiers = {
        fit: RedisTier(
            RedisTierConfig.model_validate({"url": redis_server.url, "fit_values": fit}), view
        )
        for fit in (True, False)
    }
    for tier in tiers.values():
        await tier.open()
    try:
        keys = random_keys(4, rng)
        for fit, tier in tiers.items():
            mine = keys[:2] if fit else keys[2:]
            fill_slots(view, range(2), rng)
            assert (await tier.store(_job(mine, range(2)))).ok
        for fit, tier in tiers.items():
            theirs = keys[2:] if fit else keys[:2]
            assert await tier.lookup(theirs, ReqContext(request_id="n")) == [False, False]
            result = await tier.load(_job(theirs, range(2, 4)))
            assert set(result.failed_keys) == set(theirs)
        for fit, tier in tiers.items():  # each still reads its own
            mine = keys[:2] if fit else keys[2:]
            assert await tier.lookup(mine, ReqContext(request_id="n")) == [True, True]
            assert (await tier.load(_job(mine, range(4, 6)))).ok
    finally:
        for tier in tiers.values():
            await tier.close()
