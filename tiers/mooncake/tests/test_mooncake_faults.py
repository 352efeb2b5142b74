"""The mooncake tier against a real master that misbehaves: the master killed in the
middle of a job and restarted, the process holding the segment killed, eviction under
a small segment, forged values under our names. Every test counts wrong bytes served:
always 0 (a block is either its stored bytes or a miss)."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from tierkv_mooncake import MooncakeTier, MooncakeTierConfig
from tierkv_mooncake.testing import MooncakeMaster, SegmentHolder

from tierkv.contract.framing import Framer
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.mac import MacKey
from tierkv.contract.slab import PrimaryView
from tierkv.driver.guarded import GuardedTier
from tierkv.testing import fill_slots, random_keys
from tierkv.testing.conformance import forge_under

pytestmark = pytest.mark.anyio

CTX = ReqContext(request_id="mooncake-faults")
BLOCK = 64 << 10
_job_ids = itertools.count(1)


def job(keys: list[OffloadKey], slots: list[int] | range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


@asynccontextmanager
async def opened(
    master: MooncakeMaster, view: PrimaryView, **fields: Any
) -> AsyncIterator[MooncakeTier]:
    config = MooncakeTierConfig.model_validate(
        {
            "master": master.master,
            "metadata_server": master.metadata_server,
            "batch_blocks": 8,
            "job_timeout": "20s",
            **fields,
        }
    )
    tier = MooncakeTier(config, view)
    await tier.open()
    try:
        yield tier
    finally:
        await tier.close()


def wrong_bytes(
    view: PrimaryView, result: JobResult, keys: list[OffloadKey], slots: list[int],
    stored: dict[OffloadKey, bytes],
) -> int:  # fmt: skip
    """Blocks a load reported ok whose bytes are not what was stored under the key."""
    ok = set(result.ok_keys)
    return sum(1 for k, s in zip(keys, slots) if k in ok and bytes(view.block(s)) != stored[k])


async def store_blocks(
    tier: MooncakeTier, view: PrimaryView, keys: list[OffloadKey], rng: random.Random
) -> dict[OffloadKey, bytes]:
    """Store `keys` from slots 0.. in one job; what each key holds."""
    slots = list(range(len(keys)))
    written = fill_slots(view, slots, rng)
    result = await tier.store(job(keys, slots))
    assert result.ok, result.error
    return {k: written[s] for k, s in zip(keys, slots)}


async def test_master_killed_mid_job_misses_opens_the_breaker_and_serves_again(
    fresh_master: MooncakeMaster,
) -> None:
    rng = random.Random(31)
    view = PrimaryView(bytearray(128 * BLOCK), BLOCK, "faults")
    with SegmentHolder(fresh_master, 64 << 20):
        async with opened(fresh_master, view, failure_threshold=2, recovery_after="1s") as tier:
            guarded = GuardedTier(tier)
            assert await guarded.open()
            keys = random_keys(64, rng)
            stored = await store_blocks(tier, view, keys, rng)
            dest = list(range(64, 128))

            results: list[JobResult] = []

            async def load_all() -> None:
                results.append(await guarded.run_job("load", job(keys, dest)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(load_all)
                await anyio.sleep(0.002)
                fresh_master.kill()  # mid-job: some batches may be done, the rest meet it
            assert wrong_bytes(view, results[0], keys, dest, stored) == 0

            # down: lookups fail, the breaker opens, the tier is a miss
            for _ in range(3):
                assert await guarded.lookup(keys[:4], CTX, timeout=10) is None
            assert not guarded.healthy("load")
            assert guarded.state == "open"

            fresh_master.start()  # empty: a master holds the only index
            deadline = time.monotonic() + 30
            answer = None
            while answer is None and time.monotonic() < deadline:
                await anyio.sleep(1.1)  # past recovery_after: the next call is the probe
                answer = await guarded.lookup(keys[:4], CTX, timeout=10)
            assert answer == [False] * 4, "what the old master held is gone: misses"
            assert guarded.healthy("load"), "a probe that succeeded closes the breaker"

            # served again: the holder remounted its segment with the new master
            result = JobResult.failure(job([], []), "not tried")
            fresh = random_keys(8, rng)
            fill_slots(view, range(8), rng)
            while time.monotonic() < deadline:
                result = await guarded.run_job("store", job(fresh, range(8)))
                if result.ok:
                    break
                await anyio.sleep(0.5)
            assert result.ok, result.error
            result = await guarded.run_job("load", job(fresh, range(64, 72)))
            assert result.ok, result.error
            assert [bytes(view.block(s)) for s in range(64, 72)] == [
                bytes(view.block(s)) for s in range(8)
            ]
            old = await guarded.run_job("load", job(keys, dest))
            assert not old.ok_keys, "blocks stored with the old master are misses"


async def test_the_segment_holders_death_loses_only_its_blocks(
    fresh_master: MooncakeMaster,
) -> None:
    rng = random.Random(32)
    view = PrimaryView(bytearray(64 * BLOCK), BLOCK, "faults")
    # the first blocks can only go to the doomed segment (the only one then); the
    # store spreads the second ones over both
    doomed = SegmentHolder(fresh_master, 16 << 20)
    survivor = SegmentHolder(fresh_master, 64 << 20)
    with doomed:
        async with opened(fresh_master, view) as tier:
            first = random_keys(16, rng)
            stored = await store_blocks(tier, view, first, rng)  # only the doomed segment
            with survivor:
                await anyio.sleep(0.5)
                second = random_keys(16, rng)
                slots = list(range(16, 32))
                written = fill_slots(view, slots, rng)
                result = await tier.store(job(second, slots))
                assert result.ok, result.error
                stored.update({k: written[s] for k, s in zip(second, slots)})
                doomed.kill()
                reported: list[OffloadKey] = []
                tier.set_removal_listener(reported.extend)
                keys, dest = first + second, list(range(32, 64))
                for slot in dest:
                    view.block(slot)[:] = bytes(BLOCK)
                served: set[OffloadKey] = set()
                for _attempt in range(6):  # transfers in flight at the kill may fail whole
                    result = await tier.load(job(keys, dest))
                    assert wrong_bytes(view, result, keys, dest, stored) == 0
                    served |= set(result.ok_keys)
                    if served:
                        break
                    await anyio.sleep(0.5)
                assert not set(first) & served, "the dead segment's blocks miss"
                assert served, f"blocks in the surviving segment load: {result.error}"
                # once the master forgets the dead client (client_ttl), lookups agree
                await anyio.sleep(fresh_master.client_ttl + 2)
                found = await tier.lookup(keys, CTX)
                assert not any(found[:16])
                assert all(found[16 + i] for i, k in enumerate(second) if k in served)


async def test_eviction_under_a_small_segment_is_misses_never_wrong_bytes(
    fresh_master: MooncakeMaster,
) -> None:
    rng = random.Random(33)
    block = 256 << 10
    view = PrimaryView(bytearray(32 * block), block, "faults")
    segment = 16 << 20  # the smallest a holder may mount: about 60 frames of 256 KiB
    with SegmentHolder(fresh_master, segment):
        async with opened(fresh_master, view) as tier:
            history: dict[OffloadKey, bytes] = {}
            for _round in range(20):  # 20 x 16 blocks: about 5x the segment
                keys = random_keys(16, rng)
                written = fill_slots(view, range(16), rng)
                result = await tier.store(job(keys, range(16)))
                for key, slot in zip(keys, range(16)):
                    if key in result.ok_keys:
                        history[key] = written[slot]
                await anyio.sleep(0.3)  # past the 200 ms lease: evictable
            keys = list(history)
            found = await tier.lookup(keys, CTX)
            assert sum(found) < len(keys), "the store evicted nothing: the segment is not small"
            loaded = 0
            for lo in range(0, len(keys), 16):
                chunk = keys[lo : lo + 16]
                dest = list(range(16, 16 + len(chunk)))
                result = await tier.load(job(chunk, dest))
                assert wrong_bytes(view, result, chunk, dest, history) == 0
                loaded += len(result.ok_keys)
            assert 0 < loaded < len(keys)
            assert loaded <= segment // block


async def test_forged_values_under_our_names_are_never_served(
    mooncake_store: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client of the store without our MAC key plants values under our names: before
    we store (a put does not replace them) and after. None is served; a forgery
    claiming our key is deleted at its first load, so the next store writes ours."""
    monkeypatch.setenv("TIERKV_MOONCAKE_TEST_MAC", os.urandom(32).hex())
    rng = random.Random(34)
    view = PrimaryView(bytearray(32 * 4096), 4096, "faults-mac")
    prefix = f"mac{rng.getrandbits(32):x}/"
    async with opened(
        mooncake_store, view, mac_key_env="TIERKV_MOONCAKE_TEST_MAC", key_prefix=prefix
    ) as tier:
        assert tier._client is not None
        raw = tier._client.store
        keys = random_keys(12, rng)
        payloads = {k: rng.randbytes(4096) for k in keys}
        # planted before our store: half claim our key id, half are unsigned
        for i, key in enumerate(keys[:6]):
            frame = (
                forge_under(tier.framer, key, rng.randbytes(4096))
                if i % 2 == 0
                else Framer(view.namespace).encode(key, rng.randbytes(4096))
            )
            assert raw.put(tier._names.name(key), frame) == 0
        for slot, key in enumerate(keys):
            view.block(slot)[:] = payloads[key]
        assert (await tier.store(job(keys, range(12)))).ok
        # planted after: a forger replaces three of ours, one signed by its own key
        other = Framer(view.namespace, MacKey(os.urandom(32)))
        for i, key in enumerate(keys[6:9]):
            name = tier._names.name(key)
            assert raw.remove(name, True) == 0
            frame = (
                other.encode(key, rng.randbytes(4096))
                if i == 0
                else forge_under(tier.framer, key, rng.randbytes(4096))
            )
            assert raw.put(name, frame) == 0
        dest = list(range(16, 28))
        result = await tier.load(job(keys, dest))
        assert wrong_bytes(view, result, keys, dest, payloads) == 0
        assert set(result.ok_keys) == set(keys[9:])
        assert tier.foreign_blocks == 4  # the three unsigned ones and the other key's
        # a store after the failed load replaces the deleted forgeries with ours
        assert (await tier.store(job(keys, range(12)))).ok
        result = await tier.load(job(keys, dest))
        assert wrong_bytes(view, result, keys, dest, payloads) == 0
        forged_ours = {keys[0], keys[2], keys[4], keys[7], keys[8]}
        assert forged_ours <= set(result.ok_keys)
        await tier.remove(keys)


async def test_a_frozen_segment_holder_ends_the_job_near_its_deadline(
    fresh_master: MooncakeMaster,
) -> None:
    """A node that stops answering (SIGSTOP) must not hold a load for Mooncake's
    default ~30 s per block: the tier sets its TCP progress timeout (`transfer_timeout`,
    here 1.5 s rounded to 2 s), so the job ends within its deadline plus that much per
    block of the batch in flight, its keys failed."""
    rng = random.Random(35)
    view = PrimaryView(bytearray(32 * BLOCK), BLOCK, "faults")
    with SegmentHolder(fresh_master, 32 << 20) as holder:
        async with opened(fresh_master, view, job_timeout="3s") as tier:
            keys = random_keys(8, rng)
            stored = await store_blocks(tier, view, keys, rng)
            holder.freeze()
            try:
                dest = list(range(16, 24))
                started = time.monotonic()
                result = await tier.load(job(keys, dest))
                elapsed = time.monotonic() - started
            finally:
                holder.thaw()
            assert wrong_bytes(view, result, keys, dest, stored) == 0
            assert not result.ok_keys
            assert elapsed < 3 + 8 * 2 + 3, f"the load took {elapsed:.1f}s"


@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_a_dead_master_never_holds_a_lookup_past_its_timeout(
    fresh_master: MooncakeMaster, fault: str
) -> None:
    """Mooncake's client takes 4-5 s to fail each call once its master is gone; the
    driver's `lookup_timeout` (50 ms here) bounds every lookup all the same, and the
    tier serves again once the master is back, without being reopened."""
    import signal

    rng = random.Random(47)
    view = PrimaryView(bytearray(32 * BLOCK), BLOCK, "dead-master")
    timeout, slack = 0.05, 0.02
    with SegmentHolder(fresh_master, 64 << 20):
        async with opened(fresh_master, view, failure_threshold=3, recovery_after="1s") as tier:
            guarded = GuardedTier(tier)
            assert await guarded.open()
            keys = random_keys(4, rng)
            await store_blocks(tier, view, keys, rng)
            assert await guarded.lookup(keys, CTX, timeout=5) == [True] * 4
            process = fresh_master._process
            assert process is not None
            if fault == "killed":
                fresh_master.kill()
            else:
                process.send_signal(signal.SIGSTOP)
            slowest = 0.0
            try:
                for _ in range(40):  # a lookup loop: ~2 s of a server's lookups
                    started = time.monotonic()
                    await guarded.lookup(keys, CTX, timeout=timeout)
                    slowest = max(slowest, time.monotonic() - started)
                    await anyio.sleep(0.05)
            finally:
                if fault == "frozen":
                    process.send_signal(signal.SIGCONT)
            assert slowest < timeout + slack, f"a lookup took {slowest * 1e3:.0f} ms"
            assert guarded.stats.abandoned_lookups >= 1
            if fault == "killed":
                fresh_master.start()  # empty: a master holds the only index
            deadline = time.monotonic() + 60
            answer = None
            while answer is None and time.monotonic() < deadline:
                await anyio.sleep(0.5)
                answer = await guarded.lookup(keys, CTX, timeout=timeout)
            assert answer is not None, "the tier was not served again"
            fresh = random_keys(4, rng)
            fill_slots(view, range(4), rng)
            result = JobResult.failure(job([], []), "not tried")
            while time.monotonic() < deadline:
                result = await guarded.run_job("store", job(fresh, range(4)))
                if result.ok:
                    break
                await anyio.sleep(0.5)
            assert result.ok, result.error
            result = await guarded.run_job("load", job(fresh, range(16, 20)))
            assert result.ok, result.error
            assert [bytes(view.block(s)) for s in range(16, 20)] == [
                bytes(view.block(s)) for s in range(4)
            ]
