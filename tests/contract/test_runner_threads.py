"""A tier's own block threads (`BlockThreads`) and its slots for thread calls
(`FreeSlots`): the cheaper hop keeps `in_thread`'s promise (a cancelled caller returns
only after its thread did), and a caller that finds a slot free still stops when it
was cancelled."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from tierkv.contract.runner import BlockThreads, FreeSlots

pytestmark = pytest.mark.anyio


async def test_a_call_returns_its_result_or_raises_its_exception() -> None:
    threads = BlockThreads(2, "test-block")
    try:
        assert await threads.run(lambda a, b: a + b, 2, 3) == 5
        assert await threads.run(threading.get_ident) != threading.get_ident()

        def fails() -> None:
            raise OSError(5, "the disk said no")

        with pytest.raises(OSError, match="the disk said no"):
            await threads.run(fails)
    finally:
        threads.close()


@pytest.mark.parametrize("shield", [False, True])
async def test_a_cancelled_caller_returns_only_after_its_thread(shield: bool) -> None:
    threads = BlockThreads(1, "test-block")
    started, finished = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        time.sleep(0.2)
        finished.set()
        return "done"

    got: list[str] = []
    with anyio.CancelScope() as scope:

        async def cancel_when_started() -> None:
            await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_when_started)
            got.append(await threads.run(slow, shield=shield))
    assert finished.is_set(), "the caller returned while its thread still ran"
    if shield:  # not cancelled until the result was back: it got it
        assert got == ["done"]
    else:
        assert scope.cancelled_caught and got == []
    threads.close()


async def test_calls_beyond_the_size_wait_for_a_thread() -> None:
    threads = BlockThreads(2, "test-block")
    running, peak = 0, 0
    lock = threading.Lock()

    def one() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(threads.run, one)
    assert peak == 2
    threads.close()
    with pytest.raises(RuntimeError):
        await threads.run(one)


async def test_free_slots_bound_the_callers_inside() -> None:
    slots = FreeSlots(2)
    inside, peak = 0, 0

    async def caller() -> None:
        nonlocal inside, peak
        async with slots:
            inside += 1
            peak = max(peak, inside)
            await anyio.sleep(0.01)
            inside -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(caller)
    assert peak == 2 and slots.free == 2


async def test_a_cancelled_caller_does_not_go_in_even_when_a_slot_is_free() -> None:
    slots = FreeSlots(1)
    entered = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with slots:
            entered = True
    assert not entered and scope.cancelled_caught
    assert slots.free == 1
