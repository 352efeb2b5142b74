"""`EngineJobs`: jobs submitted from an engine's thread, each ended exactly once, and a
drain that never returns while a job may still write into the engine's memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import pytest

from tierkv.driver.engine_jobs import EngineJobs
from tierkv.driver.loop_thread import LoopThread


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-engine-jobs")
    yield thread
    thread.stop()


def test_a_job_ends_once_whoever_ends_it_first(loop: LoopThread) -> None:
    jobs: EngineJobs[str] = EngineJobs(loop, "t")
    jobs.add(1, "one")
    assert jobs.pending()
    with jobs.ending(1) as record:
        assert record == "one"
        assert jobs.pending()  # ended, not yet published: a drain keeps waiting
    with jobs.ending(1) as again:
        assert again is None
    assert not jobs.pending()


def test_drain_cancels_what_runs_past_its_timeout(loop: LoopThread) -> None:
    jobs: EngineJobs[str] = EngineJobs(loop, "t")
    reported: list[str] = []

    async def run() -> None:
        with jobs.cancellable(7):
            await anyio.sleep(60)
        with jobs.ending(7) as record:
            reported.append(f"{record} cancelled")

    jobs.add(7, "seven")
    loop.spawn(run)
    jobs.drain(0.05, 5.0, lambda job_id, why: reported.append(why))
    assert reported == ["seven cancelled"] and not jobs.pending()


def test_drain_refuses_to_return_while_a_job_cannot_end(loop: LoopThread) -> None:
    jobs: EngineJobs[str] = EngineJobs(loop, "t")
    release = threading.Event()

    async def stuck() -> None:
        with jobs.cancellable(3):
            with anyio.CancelScope(shield=True):  # a thread in the kernel
                await anyio.to_thread.run_sync(release.wait)
        with jobs.ending(3):
            pass

    jobs.add(3, "three")
    loop.spawn(stuck)
    with pytest.raises(RuntimeError, match="1 jobs did not end within drain_timeout"):
        jobs.drain(0.05, 0.05, lambda job_id, why: None)
    release.set()
    assert jobs.wait(5.0) == []


def test_drain_with_the_loop_gone_fails_every_job_at_once(loop: LoopThread) -> None:
    jobs: EngineJobs[str] = EngineJobs(loop, "t")
    jobs.add(1, "one")
    loop.stop()
    failed: list[tuple[int, str]] = []

    def fail(job_id: int, why: str) -> None:
        failed.append((job_id, why))
        with jobs.ending(job_id):
            pass

    jobs.drain(5.0, 5.0, fail)
    assert failed == [(1, "the tier's event-loop thread is gone")] and not jobs.pending()
