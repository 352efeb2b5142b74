"""The tier conformance suite: one import proves a tier keeps the contract.

    from tierkv.testing import TierConformanceSuite

    class TestMyTier(TierConformanceSuite):
        def make_tier(self, primary, *, capacity_blocks):
            return MyTier(MyTier.Config(type="mytier", ...), primary)

        async def corrupt(self, tier, key):
            ...  # flip a byte of the stored payload of `key`

Run with pytest (the suite uses anyio's pytest plugin, which ships with anyio, and
hypothesis). Set `supports_capacity = False` for a tier with no capacity bound.
Every test opens a fresh tier and closes it.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import ClassVar, NoReturn

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import Field

from tierkv.errors import TierUnavailable
from tierkv.jobs import JobMetadata, JobResult, ReqContext
from tierkv.keys import OffloadKey, make_offload_key
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.primary import PrimaryTier
from tierkv.slab import PrimaryView
from tierkv.tier import SecondaryTierManager, TierConfig
from tierkv.units import Duration

CTX = ReqContext(request_id="conformance")


def random_keys(n: int, rng: random.Random | None = None, group: int = 0) -> list[OffloadKey]:
    """`n` distinct random offload keys."""
    rng = rng or random.Random()
    return [make_offload_key(rng.randbytes(16), group) for _ in range(n)]


def fill_slots(view: PrimaryView, slots: Sequence[int], rng: random.Random) -> dict[int, bytes]:
    """Write random bytes into `slots`; return what was written."""
    written = {}
    for slot in slots:
        data = rng.randbytes(view.block_bytes)
        view.block(slot)[:] = data
        written[slot] = data
    return written


def assert_partition(result: JobResult, job: JobMetadata) -> None:
    """Every key of the job appears exactly once in the result."""
    assert result.job_id == job.job_id
    assert sorted(result.ok_keys + result.failed_keys) == sorted(job.keys)


class TierConformanceSuite:
    """Subclass as `Test...` and implement `make_tier` and `corrupt`."""

    pytestmark = pytest.mark.anyio

    block_bytes: ClassVar[int] = 4096
    num_slots: ClassVar[int] = 32
    namespace: ClassVar[str] = "tierkv-conformance"
    supports_capacity: ClassVar[bool] = True

    # -- hooks --------------------------------------------------------------------
    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None
    ) -> SecondaryTierManager:
        """A new, unopened tier over `primary`. With `capacity_blocks`, size it to
        hold about that many blocks (frames included); None means roomy."""
        raise NotImplementedError

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        """Damage the stored bytes of `key` (flip a payload byte) behind the tier's back."""
        raise NotImplementedError

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    # -- helpers ------------------------------------------------------------------
    _job_ids = 0

    def job(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> JobMetadata:
        TierConformanceSuite._job_ids += 1
        return JobMetadata(TierConformanceSuite._job_ids, tuple(keys), tuple(slots), CTX)

    def primary(self) -> PrimaryTier:
        return PrimaryTier(
            self.num_slots, self.block_bytes, pin_memory=False, namespace=self.namespace
        )

    @asynccontextmanager
    async def opened(
        self, view: PrimaryView, capacity_blocks: int | None = None
    ) -> AsyncIterator[SecondaryTierManager]:
        tier = self.make_tier(view, capacity_blocks=capacity_blocks)
        await tier.open()
        try:
            yield tier
        finally:
            await tier.close()

    async def store_random(
        self, tier: SecondaryTierManager, view: PrimaryView, n: int, rng: random.Random
    ) -> dict[OffloadKey, bytes]:
        keys = random_keys(n, rng)
        slots = list(range(n))
        written = fill_slots(view, slots, rng)
        job = self.job(keys, slots)
        result = await tier.store(job)
        assert_partition(result, job)
        assert result.ok, f"store failed: {result.error}"
        return {k: written[s] for k, s in zip(keys, slots)}

    # -- the contract -------------------------------------------------------------
    async def test_round_trip_is_byte_exact(self) -> None:
        rng = random.Random(1)
        view = self.primary().view
        async with self.opened(view) as tier:
            stored = await self.store_random(tier, view, 8, rng)
            keys = list(stored)
            dest = list(range(8, 16))
            for slot in dest:
                view.block(slot)[:] = bytes(self.block_bytes)
            job = self.job(keys, dest)
            result = await tier.load(job)
            assert_partition(result, job)
            assert result.ok, result.error
            for key, slot in zip(keys, dest):
                assert bytes(view.block(slot)) == stored[key]

    async def test_lookup_is_batched_and_ordered(self) -> None:
        rng = random.Random(2)
        view = self.primary().view
        async with self.opened(view) as tier:
            stored = list(await self.store_random(tier, view, 4, rng))
            absent = random_keys(3, rng)
            query = [absent[0], stored[0], stored[1], absent[1], stored[3], absent[2]]
            assert await tier.lookup(query, CTX) == [False, True, True, False, True, False]
            assert await tier.lookup([], CTX) == []

    async def test_load_reports_partial_success_per_key(self) -> None:
        rng = random.Random(3)
        view = self.primary().view
        async with self.opened(view) as tier:
            stored = await self.store_random(tier, view, 3, rng)
            missing = random_keys(2, rng)
            keys = [missing[0], *stored, missing[1]]
            job = self.job(keys, list(range(10, 15)))
            result = await tier.load(job)
            assert_partition(result, job)
            assert set(result.ok_keys) == set(stored)
            assert set(result.failed_keys) == set(missing)
            assert result.error
            for key, slot in zip(keys[1:4], range(11, 14)):
                assert bytes(view.block(slot)) == stored[key]

    async def test_remove_deletes_and_ignores_unknown_keys(self) -> None:
        rng = random.Random(4)
        view = self.primary().view
        async with self.opened(view) as tier:
            keys = list(await self.store_random(tier, view, 4, rng))
            await tier.remove([keys[1], keys[2], *random_keys(1, rng)])
            assert await tier.lookup(keys, CTX) == [True, False, False, True]
            result = await tier.load(self.job(keys[1:3], [20, 21]))
            assert set(result.failed_keys) == set(keys[1:3])
            await tier.remove([])

    async def test_capacity_evicts_older_blocks(self) -> None:
        if not self.supports_capacity:
            pytest.skip(f"{type(self).__name__} declares no capacity bound")
        rng = random.Random(5)
        view = self.primary().view
        capacity = 4
        async with self.opened(view, capacity_blocks=capacity) as tier:
            keys: list[OffloadKey] = []
            contents: dict[OffloadKey, bytes] = {}
            for i in range(capacity + 6):
                [key] = random_keys(1, rng)
                contents[key] = fill_slots(view, [i], rng)[i]
                result = await tier.store(self.job([key], [i]))
                assert result.ok, result.error
                keys.append(key)
            present = await tier.lookup(keys, CTX)
            assert 1 <= sum(present) <= capacity
            assert present[-1], "the block stored last must still be there"
            held = [k for k, p in zip(keys, present) if p]
            result = await tier.load(self.job(held, list(range(16, 16 + len(held)))))
            assert result.ok, result.error
            for key, slot in zip(held, range(16, 16 + len(held))):
                assert bytes(view.block(slot)) == contents[key]

    async def test_corrupted_block_fails_its_key_and_is_deleted(self) -> None:
        rng = random.Random(6)
        view = self.primary().view
        async with self.opened(view) as tier:
            stored = await self.store_random(tier, view, 3, rng)
            keys = list(stored)
            await self.corrupt(tier, keys[1])
            job = self.job(keys, [20, 21, 22])
            result = await tier.load(job)
            assert_partition(result, job)
            assert result.failed_keys == (keys[1],)
            assert result.error
            assert bytes(view.block(20)) == stored[keys[0]]
            assert bytes(view.block(22)) == stored[keys[2]]
            assert await tier.lookup(keys, CTX) == [True, False, True]

    async def test_close_finishes_in_flight_work(self) -> None:
        rng = random.Random(7)
        view = self.primary().view
        tier = self.make_tier(view, capacity_blocks=None)
        await tier.open()
        keys = random_keys(self.num_slots, rng)
        fill_slots(view, range(self.num_slots), rng)
        job = self.job(keys, range(self.num_slots))
        results: list[JobResult] = []

        async def run_store() -> None:
            results.append(await tier.store(job))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_store)
            await anyio.sleep(0)
            await tier.close()
        assert len(results) == 1
        assert_partition(results[0], job)
        assert results[0].ok, "close() must let a running store finish"

    async def test_failed_load_leaves_tier_usable(self) -> None:
        rng = random.Random(8)
        view = self.primary().view
        async with self.opened(view) as tier:
            missing = random_keys(2, rng)
            result = await tier.load(self.job(missing, [0, 1]))
            assert set(result.failed_keys) == set(missing)
            stored = await self.store_random(tier, view, 2, rng)
            result = await tier.load(self.job(list(stored), [5, 6]))
            assert result.ok, result.error

    # -- the invariant, property-based ----------------------------------------------
    @settings(
        max_examples=15,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.differing_executors,
        ],
    )
    @given(
        ops=st.lists(
            st.tuples(st.sampled_from(["store", "load", "remove"]), st.integers(0, 11)),
            min_size=1,
            max_size=30,
        )
    )
    def test_reads_back_what_was_stored_or_misses(self, ops: list[tuple[str, int]]) -> None:
        """Whatever the sequence of stores, loads and removes, a load of a key either
        returns exactly the bytes stored under it or reports a miss; a removed key misses."""
        anyio.run(self._run_ops, ops)

    async def _run_ops(self, ops: list[tuple[str, int]]) -> None:
        rng = random.Random(os.urandom(8))
        view = self.primary().view
        keys = random_keys(12, rng)
        content = {k: rng.randbytes(self.block_bytes) for k in keys}
        removed: set[OffloadKey] = set()
        async with self.opened(view) as tier:
            for op, index in ops:
                key = keys[index]
                if op == "store":
                    view.block(0)[:] = content[key]
                    result = await tier.store(self.job([key], [0]))
                    if result.ok:
                        removed.discard(key)
                elif op == "remove":
                    await tier.remove([key])
                    removed.add(key)
                else:
                    view.block(1)[:] = bytes(self.block_bytes)
                    result = await tier.load(self.job([key], [1]))
                    if result.ok:
                        assert key not in removed
                        assert bytes(view.block(1)) == content[key]
                    else:
                        assert result.failed_keys == (key,)


# -- a tier that misbehaves on request, for orchestrator tests and demos ----------------
class FaultyTierConfig(MemoryTierConfig):
    delay: Duration = Field(default=0.0, description="added to every store and load job")
    lookup_delay: Duration = Field(default=0.0, description="added to every lookup")


class FaultyTier(MemoryTier):
    """The `memory` tier plus switches to make it slow, down, hung or lying.

    Register it with `tierkv.register_tier(FaultyTier)` and use `type: faulty`.
    Switches (set on the instance, e.g. `cache.tier("faulty").down = True`):
    `down` (every call raises TierUnavailable), `fail_jobs` (the next N jobs raise),
    `hang` (jobs wait until `hang` is cleared... or forever), `gate` (jobs wait for this
    event), `lie_about` (lookup claims these keys; their loads fail). `calls` logs
    (operation, keys) of every call.
    """

    Config = FaultyTierConfig
    config: FaultyTierConfig

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self.down = False
        self.fail_jobs = 0
        self.hang = False
        self.gate: anyio.Event | None = None
        self.lie_about: set[OffloadKey] = set()
        self.calls: list[tuple[str, tuple[OffloadKey, ...]]] = []

    @staticmethod
    def get_tier_type() -> str:
        return "faulty"

    async def _misbehave(self, op: str, keys: Sequence[OffloadKey]) -> None:
        self.calls.append((op, tuple(keys)))
        if self.down:
            raise TierUnavailable("faulty tier is down")
        if op != "lookup":
            if self.fail_jobs > 0:
                self.fail_jobs -= 1
                raise TierUnavailable("faulty tier failed this job")
            if self.gate is not None:
                await self.gate.wait()
            while self.hang:
                await anyio.sleep(0.01)
            if self.config.delay:
                await anyio.sleep(self.config.delay)
        elif self.config.lookup_delay:
            await anyio.sleep(self.config.lookup_delay)

    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        await self._misbehave("lookup", keys)
        found = await super().lookup(keys, ctx)
        return [f or k in self.lie_about for k, f in zip(keys, found)]

    async def store(self, job: JobMetadata) -> JobResult:
        await self._misbehave("store", job.keys)
        return await super().store(job)

    async def load(self, job: JobMetadata) -> JobResult:
        await self._misbehave("load", job.keys)
        lies = [k for k in job.keys if k in self.lie_about and k not in self._frames]
        if not lies:
            return await super().load(job)
        result = await super().load(job)
        return JobResult.partial(job, {k: "faulty tier lied" for k in result.failed_keys})

    def stored_keys(self) -> set[OffloadKey]:
        return set(self._frames)


def missing_server(what: str, exc: BaseException) -> NoReturn:
    """A test needs a real server (`what`) that is not installed: under `CI=true` that
    is a failure (CI must install it), elsewhere a skip with the reason."""
    reason = f"needs {what}: {exc}"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: a missing server is a failure, not a skip)")
    pytest.skip(reason)
