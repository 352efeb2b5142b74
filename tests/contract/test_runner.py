"""The per-key job runner every tier uses (tierkv.contract.runner): partial results, the
deadline and late keys, job-wide aborts, the concurrency bound, and cancellation that
waits for the worker threads."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import anyio
import pytest

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.contract.runner import Batch, JobAborted, in_batches, in_thread, run_job

pytestmark = pytest.mark.anyio


def make_job(n: int) -> JobMetadata:
    keys = tuple(make_offload_key(bytes([i + 1]) * 8, 0) for i in range(n))
    return JobMetadata(1, keys, tuple(range(n)))


async def test_partial_results_name_every_key_once() -> None:
    job = make_job(6)

    async def work(batch: Batch) -> Mapping[OffloadKey, str] | None:
        [(key, slot)] = batch
        if slot == 1:
            return {key: "medium said no"}
        if slot == 3:
            raise RuntimeError("a bug")
        return None

    result = await run_job(job, work, label="test store", concurrency=3, timeout=None)
    assert set(result.failed_keys) == {job.keys[1], job.keys[3]}
    assert set(result.ok_keys) == set(job.keys) - {job.keys[1], job.keys[3]}
    assert "medium said no" in (result.error or "")
    assert "unexpected RuntimeError: a bug" in (result.error or "")


async def test_concurrency_is_bounded() -> None:
    job = make_job(12)
    running = 0
    peak = 0

    async def work(batch: Batch) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0)
        await anyio.sleep(0)
        running -= 1

    result = await run_job(job, work, label="t", concurrency=3, timeout=None)
    assert result.ok
    assert peak == 3


async def test_an_abort_fails_the_rest_of_the_job_without_trying_it() -> None:
    job = make_job(5)
    tried: list[int] = []

    async def work(batch: Batch) -> None:
        tried.extend(slot for _key, slot in batch)
        if batch[0][1] == 2:
            raise JobAborted("server unreachable")

    result = await run_job(
        job, work, label="t", concurrency=1, timeout=None, batches=in_batches(job, 2)
    )
    assert tried == [0, 1, 2, 3]
    assert result.ok_keys == job.keys[:2]
    assert result.failed_keys == job.keys[2:]
    assert "server unreachable" in (result.error or "")
    assert "not tried: server unreachable" in (result.error or "")


async def test_late_keys_fail_at_the_deadline_and_done_keys_stay_ok() -> None:
    job = make_job(4)
    never = anyio.Event()
    late_seen: list[OffloadKey] = []

    async def work(batch: Batch) -> None:
        if batch[0][1] % 2:
            await never.wait()  # a medium that never answers

    result = await run_job(
        job, work, label="slow load", concurrency=4, timeout=0.05, on_late=late_seen.extend
    )
    assert set(result.ok_keys) == {job.keys[0], job.keys[2]}
    assert set(result.failed_keys) == {job.keys[1], job.keys[3]}
    assert set(late_seen) == {job.keys[1], job.keys[3]}
    assert "slow load did not finish within job_timeout=0.05s" in (result.error or "")


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_cancellation_and_the_deadline_wait_for_worker_threads(how: str) -> None:
    """A job whose batch is in a worker thread ends (by its deadline or by the caller's
    cancellation) only after that thread returned: it never touches a slot later."""
    job = make_job(2)
    started = threading.Event()
    release = threading.Event()
    finished: list[bool] = []

    def blocking(slot: int) -> None:
        started.set()
        release.wait(timeout=30)
        finished.append(True)

    async def work(batch: Batch) -> None:
        await in_thread(blocking, batch[0][1])

    def let_go() -> None:  # another thread lets the worker finish, a bit later
        started.wait(timeout=30)
        threading.Timer(0.1, release.set).start()

    threading.Thread(target=let_go).start()
    if how == "deadline":
        result = await run_job(job, work, label="t", concurrency=1, timeout=0.01)
        assert result.failed_keys  # late: the deadline passed mid-thread
    else:
        with anyio.CancelScope() as scope:

            async def cancel_when_started() -> None:
                await anyio.to_thread.run_sync(started.wait, 30)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_started)
                await run_job(job, work, label="t", concurrency=1, timeout=None)
        assert scope.cancelled_caught
    assert finished == [True], f"{how}: the runner returned before its thread finished"
