"""`GuardedTier`: the one driver between a tier and the cache or an engine adapter."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import pytest

from tierkv.contract.errors import TierUnavailable
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.slab import PrimaryView
from tierkv.driver import GuardedTier, backstop_after
from tierkv.driver.checks import checked_result
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.testing import FaultyTier, random_keys
from tierkv.testing.faulty import FaultyTierConfig

pytestmark = pytest.mark.anyio

BLOCK = 256
SLOTS = 16


def view() -> PrimaryView:
    return PrimaryView(bytearray(BLOCK * SLOTS), BLOCK, "test")


def faulty(**fields: Any) -> tuple[GuardedTier, FaultyTier]:
    tier = FaultyTier(FaultyTierConfig(type="faulty", **fields), view())
    return GuardedTier(tier, name="faulty"), tier


def job(n: int, job_id: int = 1) -> JobMetadata:
    return JobMetadata(job_id, tuple(random_keys(n)), tuple(range(n)))


async def opened(**fields: Any) -> tuple[GuardedTier, FaultyTier]:
    guarded, tier = faulty(**fields)
    assert await guarded.open()
    return guarded, tier


def test_the_backstop_is_the_deadline_plus_a_bounded_grace() -> None:
    assert backstop_after(0.1) == pytest.approx(0.35)  # at least 0.25 s of grace
    assert backstop_after(2.0) == pytest.approx(3.0)  # half the deadline
    assert backstop_after(30.0) == pytest.approx(35.0)  # at most 5 s


async def test_keys_stored_by_the_tiers_deadline_are_kept_and_count_as_progress() -> None:
    guarded, tier = await opened(job_timeout="200ms", stall_after_keys=3)
    j = job(6)
    outcome = await guarded.run("store", j)
    assert outcome.result.ok_keys == j.keys[:3]
    assert outcome.result.failed_keys == j.keys[3:]
    assert "job_timeout" in (outcome.result.error or "")
    assert outcome.failure == "keys_failed"
    assert tier.stored_keys() == set(j.keys[:3])
    stats = guarded.stats
    assert (stats.blocks_stored, stats.failed_keys, stats.errors) == (3, 3, 0)
    assert stats.deadline_breaches == 0 and guarded.state == "closed"


async def test_a_job_that_moved_nothing_by_its_deadline_counts_against_the_tier() -> None:
    guarded, _ = await opened(job_timeout="100ms", stall_after_keys=0, failure_threshold=1)
    outcome = await guarded.run("load", job(2))
    assert outcome.result.ok_keys == () and outcome.failure == "keys_failed"
    assert guarded.stats.errors == 1 and guarded.state == "open"


async def test_a_tier_silent_past_the_backstop_breaks_the_contract(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guarded, tier = await opened(job_timeout="100ms")
    tier.hang = True
    j = job(3)
    started = anyio.current_time()
    with caplog.at_level(logging.WARNING, logger="tierkv.driver.guarded"):
        outcome = await guarded.run("store", j)
    assert anyio.current_time() - started < 2
    assert outcome.failure == "timeout" and outcome.result.failed_keys == j.keys
    assert "timed out after 0.35s (job_timeout=0.1s)" in (outcome.result.error or "")
    assert guarded.stats.deadline_breaches == 1 and guarded.stats.errors == 1
    assert "broke its deadline" in caplog.text
    tier.hang = False


async def test_a_raising_tier_fails_its_job_and_opens_the_breaker() -> None:
    guarded, tier = await opened(failure_threshold=2, recovery_after="1h")
    tier.down = True
    for i in range(2):
        outcome = await guarded.run("load", job(2, job_id=i))
        assert outcome.failure == "error"
        assert "TierUnavailable: faulty tier is down" in (outcome.result.error or "")
    assert guarded.state == "open" and guarded.serving == "write_only"
    assert guarded.admit("load", 2, 0) == "not_serving"
    assert guarded.stats.skipped_unhealthy == 2
    assert await guarded.lookup(random_keys(1), ReqContext(), None) is None
    # reads and writes are judged apart: failed loads do not keep stores from trying
    assert guarded.admit("store", 2, 2 * BLOCK) is None
    guarded.release("store", 2 * BLOCK)


async def test_stores_past_max_inflight_bytes_are_refused_until_released() -> None:
    guarded, _ = await opened(max_inflight_bytes=2 * BLOCK)
    assert guarded.admit("store", 4, 4 * BLOCK) is None  # nothing in flight: always goes
    assert guarded.admit("store", 1, BLOCK) == "max_inflight"
    assert guarded.admit("load", 8, 8 * BLOCK) is None  # loads have no byte budget
    guarded.release("store", 4 * BLOCK)
    assert guarded.admit("store", 2, 2 * BLOCK) is None
    assert guarded.stats.drops == 1 and guarded.stats.inflight_bytes == 2 * BLOCK


async def test_a_tier_is_held_to_every_key_exactly_once() -> None:
    j = job(3)
    other = JobResult(99, j.keys, (), None)
    assert checked_result(j, other, "t").failed_keys == j.keys
    assert checked_result(j, "nonsense", "t").ok_keys == ()
    twice = JobResult(j.job_id, (j.keys[0], j.keys[0], random_keys(1)[0]), (), None)
    checked = checked_result(j, twice, "t")
    assert checked.ok_keys == (j.keys[0],) and checked.failed_keys == j.keys[1:]
    assert checked.error == "tier t did not report every key"


async def test_a_block_removed_while_its_store_ran_is_not_reported_held() -> None:
    guarded, tier = await opened()
    told: list[tuple[Any, ...]] = []
    guarded = GuardedTier(tier, name="faulty", on_removed=lambda g, keys: told.append(keys))
    guarded.opened = True
    j = job(2)
    gate = anyio.Event()
    tier.gate = gate
    async with anyio.create_task_group() as tg:
        results: list[JobResult] = []

        async def store() -> None:
            results.append(await guarded.run_job("store", j))

        tg.start_soon(store)
        await anyio.sleep(0.01)
        tier.report_removed([j.keys[1]])  # evicted while the store is still running
        gate.set()
    assert results[0].ok_keys == (j.keys[0],) and results[0].failed_keys == (j.keys[1],)
    assert told == [(j.keys[1],)]


async def test_a_wrong_lookup_answer_is_a_miss_and_an_error() -> None:
    guarded, tier = await opened()

    async def short(keys: Any, ctx: Any) -> list[bool]:
        return [True]

    tier.lookup = short  # type: ignore[method-assign]
    assert await guarded.lookup(random_keys(3), ReqContext(), 1.0) is None
    assert guarded.stats.errors == 1


async def test_touch_is_a_hint_a_failure_is_not_raised() -> None:
    guarded, tier = await opened()

    async def broken(keys: Any) -> None:
        raise OSError("gone")

    tier.touch = broken  # type: ignore[method-assign]
    assert await guarded.touch(random_keys(2), 1.0) is False
    assert guarded.stats.errors == 0


class _Flaky(MemoryTier):
    """Fails to open while `refuse` is set."""

    refuse = True

    async def open(self) -> None:
        if self.refuse:
            raise ConnectionRefusedError("no server")


def flaky(required: bool) -> GuardedTier:
    config = MemoryTierConfig(type="memory", required=required, recovery_after="10ms")
    return GuardedTier(_Flaky(config, view()), name="flaky")


async def test_a_required_tier_that_fails_to_open_raises_with_the_cause() -> None:
    guarded = flaky(required=True)
    with pytest.raises(TierUnavailable, match="tier 'flaky' failed to open: ConnectionRefused"):
        await guarded.open()
    assert not guarded.opened


async def test_an_optional_tier_is_reopened_until_it_works_and_stops_at_close() -> None:
    guarded = flaky(required=False)
    assert await guarded.open() is False and not guarded.usable("load")
    tier = guarded.tier
    assert isinstance(tier, _Flaky)
    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded.keep_opening)
        await anyio.sleep(0.05)
        assert not guarded.opened
        tier.refuse = False
        with anyio.fail_after(2):
            while not guarded.opened:
                await anyio.sleep(0.01)
    assert guarded.usable("load") and guarded.usable("store")
    await guarded.close()
    assert not guarded.opened and guarded.closed
    never = flaky(required=False)
    await never.close()  # closed before it opened: keep_opening ends at once
    with anyio.fail_after(1):
        await never.keep_opening()
    assert not never.opened


async def test_a_timeout_the_tier_raises_is_its_error_not_a_breach() -> None:
    guarded, tier = await opened()

    async def times_out(job: JobMetadata) -> JobResult:
        raise TimeoutError("socket read timed out")

    tier.store = times_out  # type: ignore[method-assign]
    outcome = await guarded.run("store", job(2))
    assert outcome.failure == "error" and guarded.stats.deadline_breaches == 0
    assert "TimeoutError: socket read timed out" in (outcome.result.error or "")


async def test_a_refused_or_withdrawn_job_gives_the_half_open_probe_back() -> None:
    guarded, tier = await opened(
        failure_threshold=1, recovery_after="20ms", max_inflight_bytes=BLOCK
    )
    assert guarded.admit("store", 1, BLOCK) is None  # in flight while the tier fails
    tier.down = True
    await guarded.run("store", job(1), admitted=True)
    assert guarded.breaker("store").state.value == "open"
    await anyio.sleep(0.05)
    assert guarded.admit("store", 1, BLOCK) == "max_inflight"  # took the probe, gave it back
    assert guarded.usable("store")
    guarded.release("store", BLOCK)
    assert guarded.admit("store", 1, BLOCK) is None  # so this one may probe
    assert not guarded.usable("store")  # ... and while it is out, no other
    guarded.withdraw("store", BLOCK)  # it did not run after all: the probe is free again
    assert guarded.usable("store") and guarded.stats.inflight_bytes == 0


async def test_an_empty_job_proves_nothing_to_the_breaker() -> None:
    guarded, _ = await opened(failure_threshold=1, recovery_after="10ms")
    guarded.tier.down = True  # type: ignore[attr-defined]
    await guarded.run("load", job(1))
    await anyio.sleep(0.03)
    guarded.tier.down = False  # type: ignore[attr-defined]
    assert guarded.admit("load", 0, 0) is None  # the probe
    await guarded.run("load", JobMetadata(9, (), ()), admitted=True)
    assert guarded.state == "half_open"
    assert guarded.usable("load")  # given back: the next call may probe


async def test_asking_whether_a_tier_serves_takes_no_probe() -> None:
    """The bug that left tiers dead until restart under SGLang and LMCache: asking
    `usable` took the half-open probe, the lookup then found it taken and was refused,
    and nobody ever reported on that probe. Asking takes nothing now: the lookup after
    it probes and closes the breaker."""
    guarded, tier = await opened(failure_threshold=1, recovery_after="20ms")
    tier.down = True
    assert await guarded.lookup(random_keys(1), ReqContext(), None) is None
    assert guarded.breaker("load").state.value == "open"
    assert not guarded.usable("load")
    tier.down = False
    await anyio.sleep(0.05)
    for _ in range(3):
        assert guarded.usable("load")  # asked again and again: still nothing taken
    assert await guarded.lookup(random_keys(2), ReqContext(), None) == [False, False]
    assert guarded.state == "closed" and guarded.serving == "read_write"


async def test_a_job_sent_without_admit_takes_its_own_permit() -> None:
    guarded, tier = await opened(failure_threshold=1, recovery_after="1h")
    tier.down = True
    await guarded.run("load", job(1))
    calls = len(tier.calls)
    outcome = await guarded.run("load", job(3, job_id=2))  # not admitted, side open
    assert outcome.failure == "refused" and len(outcome.result.failed_keys) == 3
    assert len(tier.calls) == calls  # never sent
    assert guarded.stats.skipped_unhealthy == 3
    assert "not serving loads" in (outcome.result.error or "")


async def test_a_tier_that_cannot_write_keeps_serving_what_it_holds() -> None:
    """A full or read-only disk fails every store; the write breaker opens, and the
    blocks the tier holds are still looked up and loaded (`serving: read_only`)."""
    guarded, tier = await opened(failure_threshold=2, recovery_after="1h")
    held = job(2)
    assert (await guarded.run("store", held)).failure is None
    tier.full = True
    for i in range(2):
        assert (await guarded.run("store", job(1, job_id=10 + i))).result.failed_keys
    assert guarded.serving == "read_only" and guarded.state == "open"
    assert guarded.admit("store", 1, BLOCK) == "not_serving"
    assert await guarded.lookup(held.keys, ReqContext(), None) == [True, True]
    outcome = await guarded.run("load", JobMetadata(20, held.keys, held.slots))
    assert outcome.failure is None and set(outcome.result.ok_keys) == set(held.keys)
    stats = guarded.refresh_stats()
    assert (stats.read_breaker, stats.write_breaker) == ("closed", "open")
    assert (stats.serving, stats.breaker) == ("read_only", "open")


class _Stuck(MemoryTier):
    """A tier whose lookup blocks in a worker thread (a client library's call to a dead
    server) until `release` is set; cancelling it waits for the thread."""

    lookup_answers_from_memory = False  # it waits on a thread

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import threading

        self.release = threading.Event()
        self.stuck = True

    async def lookup(self, keys: Any, ctx: ReqContext) -> list[bool]:
        from tierkv.contract.runner import in_thread

        if self.stuck:
            await in_thread(self.release.wait)
        return await super().lookup(keys, ctx)


async def test_a_lookup_stuck_in_a_thread_returns_within_its_timeout() -> None:
    """`lookup_timeout` bounds a lookup whatever the tier does: one stuck in a blocking
    call is left behind (counted), up to MAX_ABANDONED_LOOKUPS, after which the tier
    is not asked until one returns; then it serves again without reopening."""
    from tierkv.driver.guarded import MAX_ABANDONED_LOOKUPS

    tier = _Stuck(MemoryTierConfig(type="memory", failure_threshold=100), view())
    guarded = GuardedTier(tier, name="stuck")
    assert await guarded.open()
    keys = random_keys(2)
    for _ in range(MAX_ABANDONED_LOOKUPS):
        started = anyio.current_time()
        assert await guarded.lookup(keys, ReqContext(), 0.05) is None
        assert anyio.current_time() - started < 0.05 + 0.02
    assert guarded.abandoned_now == MAX_ABANDONED_LOOKUPS
    assert guarded.stats.abandoned_lookups == MAX_ABANDONED_LOOKUPS
    assert guarded.stats.lookup_timeouts == MAX_ABANDONED_LOOKUPS
    started = anyio.current_time()
    assert await guarded.lookup(keys, ReqContext(), 0.05) is None  # not asked at all
    assert anyio.current_time() - started < 0.01
    assert guarded.stats.skipped_unhealthy == 1
    tier.stuck = False
    tier.release.set()  # the client library finally gives up
    with anyio.fail_after(5):
        while guarded.abandoned_now:
            await anyio.sleep(0.01)
    assert await guarded.lookup(keys, ReqContext(), 0.05) == [False, False]


async def test_a_caller_cancelled_mid_lookup_does_not_wait_for_the_tiers_thread() -> None:
    tier = _Stuck(MemoryTierConfig(type="memory"), view())
    guarded = GuardedTier(tier, name="stuck")
    assert await guarded.open()
    started = anyio.current_time()
    with anyio.move_on_after(0.05):
        await guarded.lookup(random_keys(1), ReqContext(), None)
    assert anyio.current_time() - started < 0.05 + 0.02
    assert guarded.abandoned_now == 1
    tier.release.set()
    with anyio.fail_after(5):
        while guarded.abandoned_now:
            await anyio.sleep(0.01)


@pytest.mark.parametrize("from_memory", [True, False])
async def test_a_tier_that_answers_from_memory_is_asked_in_the_callers_task(
    from_memory: bool,
) -> None:
    """An in-memory index is asked directly (no task, one loop step less); any other
    tier's lookup runs in a task of its own, which lookup_timeout can leave behind."""
    import asyncio

    seen: list[object] = []

    class Probe(MemoryTier):
        lookup_answers_from_memory = from_memory

        async def lookup(self, keys: Any, ctx: ReqContext) -> list[bool]:
            seen.append(asyncio.current_task())
            return await super().lookup(keys, ctx)

    guarded = GuardedTier(Probe(MemoryTierConfig(type="memory"), view()), name="probe")
    assert await guarded.open()
    assert await guarded.lookup(random_keys(1), ReqContext(), 1.0) == [False]
    assert (seen[0] is asyncio.current_task()) is from_memory


class _ShieldedThread(MemoryTier):
    """A load whose copy runs in a worker thread shielded from cancellation (as the
    nvme tier's chunks are), slow enough to be cancelled in the middle."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.thread_done = False

    async def load(self, job: JobMetadata) -> JobResult:
        def copy() -> None:
            time.sleep(0.3)
            self.thread_done = True

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(copy)
        return await super().load(job)


async def test_a_cancelled_caller_of_an_abandonable_job_waits_for_its_shielded_thread() -> None:
    """`run(..., abandon=True)` cancelled by its caller (a request given up) cancels
    the tier's job and waits for it: a thread call the tier shields must have
    returned when the caller's cancellation completes, or it would still write slots
    the cache hands out again (a native task cancel went through the shield)."""
    tier = _ShieldedThread(MemoryTierConfig(type="memory", job_timeout=5.0), view())
    guarded = GuardedTier(tier, name="shielded")
    await guarded.open()
    keys = job(2)
    assert (await guarded.run("store", keys)).result.ok
    with anyio.move_on_after(0.1):
        await guarded.run("load", keys, abandon=True)
    assert tier.thread_done, "the caller ended while the tier's thread still ran"
    await guarded.close()
