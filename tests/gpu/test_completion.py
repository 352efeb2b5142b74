"""How a waiting task learns that its copy is done, driven on CPU by the fake CUDA
device of test_ordering.py (copies run when the test runs the device):

- a short copy's waiter looks at it from the event loop, between the loop's other
  tasks, and gets its result without the completion thread ever starting;
- one that outlasts the window, or any waiter with polling off, hands the copies in
  flight to the completion thread and sleeps until it wakes the loop;
- a long copy goes to the thread at once; `drain` and results nobody awaits need no
  thread either way;
- submitting starts no thread (waking it there cost a one-block submit ~50 us).
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from tests.gpu.test_bounded import _worker
from tests.gpu.test_ordering import Rig
from tierkv.contract.errors import ConfigError
from tierkv.gpu import TransferSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def thread_started(rig: Rig, direction: str = "store") -> bool:
    return rig.worker._lanes[direction].completions._thread is not None  # type: ignore[index]


async def run_device_after(rig: Rig, *, turns: int = 0, seconds: float = 0.0) -> None:
    """Run the fake device after `turns` passes of the loop or `seconds`: the copy
    ends while its waiter is already waiting."""
    for _ in range(turns):
        await anyio.lowlevel.checkpoint()
    if seconds:
        await anyio.sleep(seconds)
    rig.device.run(prefer=rig.streams.lanes)


def store(block: int = 3, slot: int = 1) -> TransferSpec:
    return TransferSpec("store", [[block]], [[slot]], [0])


async def test_a_short_copy_is_seen_from_the_loop_without_the_completion_thread() -> None:
    rig = Rig("dma", worker_ready="engine stream")
    rig.kv[0][0][3].fill_(4)
    handle = rig.worker.submit(store())
    assert handle._poll and not thread_started(rig), "submitting starts no thread"
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_device_after(rig, turns=3))
            result = await rig.worker.wait(handle)
    assert result.num_blocks == 1 and rig.slab[1][:64].tolist() == [4] * 64
    assert not thread_started(rig), "the waiter saw the copy end from the loop"


async def test_with_polling_off_the_waiter_sleeps_until_the_completion_thread_wakes_it() -> (
    None
):
    rig = Rig("dma", worker_ready="engine stream", completion_poll_us=0)
    handle = rig.worker.submit(store())
    assert not handle._poll
    started: list[bool] = []

    async def device() -> None:
        await anyio.sleep(0.02)
        started.append(thread_started(rig))  # the waiter is asleep by now
        rig.device.run(prefer=rig.streams.lanes)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device)
            await rig.worker.wait(handle)
    assert started == [True]
    rig.worker.close()


async def test_a_short_copy_that_outlasts_the_window_is_handed_to_the_thread() -> None:
    rig = Rig("dma", worker_ready="engine stream", completion_poll_us=2000)
    handle = rig.worker.submit(store())
    seen: list[bool] = []

    async def device() -> None:
        await anyio.sleep(0.05)  # far past the 2 ms window
        seen.append(thread_started(rig))
        rig.device.run(prefer=rig.streams.lanes)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device)
            await rig.worker.wait(handle)
    assert seen == [True], "the waiter stopped looking and slept on the thread"
    assert handle.done()
    rig.worker.close()


async def test_a_long_copy_goes_to_the_thread_at_once() -> None:
    rig = Rig("dma", worker_ready="engine stream", completion_poll_us=10_000_000)
    rig.worker._poll_max_pages = 2  # this rig's one block is 2 pages: "long"
    handle = rig.worker.submit(store())
    assert not handle._poll
    seen: list[bool] = []

    async def device() -> None:
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        seen.append(thread_started(rig))  # with a 10 s window, only if not polled
        rig.device.run(prefer=rig.streams.lanes)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device)
            await rig.worker.wait(handle)
    assert seen == [True]
    rig.worker.close()


async def test_waits_keep_submission_order_when_the_later_copy_ends_first_in_view() -> None:
    """Two short copies on one lane, the later one's waiter first in line to look:
    results still come in submission order, each to its own waiter."""
    rig = Rig("dma", worker_ready="engine stream")
    first = rig.worker.submit(store(3, 1))
    second = rig.worker.submit(store(4, 2))
    order: list[int] = []

    async def waits(handle: Any) -> None:
        result = await rig.worker.wait(handle)
        order.append(result.transfer_id)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waits, first)
            tg.start_soon(waits, second)
            tg.start_soon(lambda: run_device_after(rig, turns=2))
    assert order == [first.transfer_id, second.transfer_id]


async def test_drain_and_unclaimed_results_need_no_waiter_of_their_own() -> None:
    rig = Rig("dma", worker_ready="engine stream")
    handles = [rig.worker.submit(store(b, s)) for b, s in ((3, 1), (5, 2))]
    assert not thread_started(rig)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_device_after(rig, seconds=0.02))
            await rig.worker.drain()  # sleeps: the copies are handed to the thread
    assert thread_started(rig) and rig.worker.num_in_flight == 0
    ids = [r.transfer_id for r in rig.worker.get_finished()]
    assert ids == [h.transfer_id for h in handles]
    rig.worker.close()
    # without any waiter or drain: reaped by the next look, no thread needed
    rig = Rig("dma", worker_ready="engine stream")
    handle = rig.worker.submit(store())
    rig.device.run(prefer=rig.streams.lanes)
    assert [r.transfer_id for r in rig.worker.get_finished()] == [handle.transfer_id]
    assert not thread_started(rig)


@pytest.mark.parametrize("bad", [-1, True, "200", float("inf"), float("nan"), None])
def test_completion_poll_us_must_be_a_non_negative_number(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"completion_poll_us: .* must be a number"):
        _worker(completion_poll_us=bad)


def test_completion_poll_us_takes_ints_and_floats() -> None:
    assert _worker(completion_poll_us=0)._poll_max_pages == 0
    assert _worker(completion_poll_us=12.5)._poll_seconds == pytest.approx(12.5e-6)
