"""Network I/O left behind by a job's deadline (tierkv.contract.runner.SlotGuard,
IOThreads and in_thread_abandoned_on_cancel): the job ends on time, and the thread it
left behind never touches a slot afterwards."""

from __future__ import annotations

import threading

import anyio
import pytest

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import make_offload_key
from tierkv.contract.runner import (
    Batch,
    IOThreads,
    SlotGuard,
    in_thread_abandoned_on_cancel,
    run_job,
)

pytestmark = pytest.mark.anyio


def make_job(n: int) -> JobMetadata:
    keys = tuple(make_offload_key(bytes([i + 1]) * 8, 0) for i in range(n))
    return JobMetadata(1, keys, tuple(range(n)))


@pytest.mark.parametrize("threads", ["anyio", "IOThreads"])
@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_a_left_behind_thread_never_writes_a_slot_after_its_job_ended(
    how: str, threads: str
) -> None:
    job = make_job(1)
    slot = bytearray(b"old")
    started = threading.Event()
    server_answers = threading.Event()  # a frozen server, thawed after the job ended
    outcome: list[bool] = []
    done = threading.Event()
    guard = SlotGuard()
    pool = IOThreads(2, "test")

    def fetch_and_write() -> None:
        started.set()
        server_answers.wait(timeout=30)
        with guard.hold() as alive:
            if alive:
                slot[:] = b"new"
            outcome.append(alive)
        done.set()

    async def work(batch: Batch) -> None:
        if threads == "anyio":
            await in_thread_abandoned_on_cancel(fetch_and_write)
        else:
            await pool.run(fetch_and_write)

    try:
        if how == "deadline":
            result = await run_job(job, work, label="t", concurrency=1, timeout=0.05)
            assert result.failed_keys == job.keys and "job_timeout" in (result.error or "")
        else:
            with anyio.CancelScope() as scope:

                async def cancel_when_started() -> None:
                    await anyio.to_thread.run_sync(started.wait, 30)
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_when_started)
                    await run_job(job, work, label="t", concurrency=1, timeout=None)
            assert scope.cancelled_caught
    finally:
        guard.close()
        pool.close()  # lets the threads go once idle; the blocked one finishes below
    assert not done.is_set(), "the job ended while its thread was still blocked"
    server_answers.set()
    assert await anyio.to_thread.run_sync(done.wait, 30)
    assert outcome == [False] and slot == b"old", "the thread wrote a slot after its job"


async def test_io_threads_return_results_and_errors_and_refuse_work_once_closed() -> None:
    pool = IOThreads(2, "test")
    assert await pool.run(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        await pool.run(lambda: 1 / 0)
    pool.close()
    with pytest.raises(RuntimeError):
        await pool.run(lambda: None)
    with pytest.raises(ValueError, match="size must be >= 1"):
        IOThreads(0, "test")


async def test_a_guard_lets_threads_of_a_live_job_write() -> None:
    guard = SlotGuard()
    slot = bytearray(b"old")

    def write() -> bool:
        with guard.hold() as alive:
            if alive:
                slot[:] = b"new"
            return alive

    assert await in_thread_abandoned_on_cancel(write)
    assert slot == b"new"
    guard.close()
    assert not await in_thread_abandoned_on_cancel(write)
