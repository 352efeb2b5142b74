"""How a waiting task learns that its copy is done, on CPU: a stand-in device whose
copies run at launch but report "begun" and "done" only when the test says so (what a
queued CUDA copy looks like to the host).

- a short copy's waiter looks at it from the event loop, between the loop's other
  tasks, and gets its result without the completion thread ever starting;
- one that outlasts the window, one still queued behind `ready` (not begun), or any
  waiter with polling off hands the copies in flight to the completion thread and
  sleeps until it wakes the loop;
- a long copy goes to the thread at once; `drain` and results nobody awaits need no
  waiter of their own;
- submitting starts no thread (waking it there cost a one-block submit ~50 us).
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from tests.gpu.test_bounded import _worker
from tierkv.contract.errors import ConfigError
from tierkv.gpu import TransferSpec, TransferWorker
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier

pytestmark = pytest.mark.anyio

PAGE = 64


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Copy:
    """A launched copy: begun and done when the test says (`begin`, `finish`)."""

    event = None

    def __init__(self) -> None:
        self._begun = False
        self._done = threading.Event()

    def begin(self) -> None:
        self._begun = True

    def finish(self) -> None:
        self._begun = True
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def started(self) -> bool:
        return self._begun

    def wait(self) -> None:
        self._done.wait()

    def seconds(self) -> float:
        return 0.0


class Controlled:
    """An asynchronous device: the bytes move at launch, completion is the test's."""

    asynchronous = True

    def __init__(self, *, begun: bool = True) -> None:
        self.copies: list[Copy] = []
        self.begun = begun

    def new_stream(self) -> None:
        return None

    def order_after(self, stream: Any, ready: Any) -> None:
        return None

    def launch(self, stream: Any, work: Any, *, current: bool = True) -> Copy:
        work(stream)
        copy = Copy()
        if self.begun:
            copy.begin()
        self.copies.append(copy)
        return copy


def rig(*, begun: bool = True, **options: Any) -> tuple[TransferWorker, Controlled]:
    device = Controlled(begun=begun)
    kv = [[torch.zeros(8, PAGE, dtype=torch.uint8), torch.zeros(8, PAGE, dtype=torch.uint8)]]
    primary = PrimaryTier(4, 2 * PAGE, pin_memory=False)
    layout = KVLayout(block_bytes=2 * PAGE, groups=(GroupSpec(block_size=4),))
    worker = TransferWorker(
        kv, primary.view, layout, gpu_block_size=4, streams=device, ready=object(), **options
    )
    return worker, device


def thread_started(worker: TransferWorker, direction: str = "store") -> bool:
    return worker._lanes[direction].completions._thread is not None  # type: ignore[index]


def store(block: int = 3, slot: int = 1) -> TransferSpec:
    return TransferSpec("store", [[block]], [[slot]], [0])


async def finish_after(copy: Copy, *, turns: int = 0, seconds: float = 0.0) -> None:
    for _ in range(turns):
        await anyio.lowlevel.checkpoint()
    if seconds:
        await anyio.sleep(seconds)
    copy.finish()


async def thread_seen_while_waiting(
    worker: TransferWorker, device: Controlled, handle: Any, until: Any
) -> bool:
    """Wait on `handle` while another task waits `until()`, notes whether the
    completion thread has started (the waiter is asleep on it), then ends the copy."""
    seen: list[bool] = []

    async def device_ends() -> None:
        await until()
        seen.append(thread_started(worker))
        device.copies[0].finish()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device_ends)
            await worker.wait(handle)
    return seen == [True]


async def two_turns() -> None:
    await anyio.lowlevel.checkpoint()
    await anyio.lowlevel.checkpoint()


async def test_a_short_copy_is_seen_from_the_loop_without_the_completion_thread() -> None:
    worker, device = rig()
    handle = worker.submit(store())
    assert handle._poll and not thread_started(worker), "submitting starts no thread"
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: finish_after(device.copies[0], turns=3))
            result = await worker.wait(handle)
    assert result.num_blocks == 1
    assert not thread_started(worker), "the waiter saw the copy end from the loop"


async def test_with_polling_off_the_waiter_sleeps_until_the_completion_thread_wakes_it() -> (
    None
):
    worker, device = rig(completion_poll_us=0)
    handle = worker.submit(store())
    assert not handle._poll
    assert await thread_seen_while_waiting(worker, device, handle, lambda: anyio.sleep(0.02))
    worker.close()


@pytest.mark.parametrize("begun", [True, False], ids=["running", "queued behind ready"])
async def test_a_copy_that_outlasts_the_window_or_has_not_begun_goes_to_the_thread(
    begun: bool,
) -> None:
    """Running, the waiter looks for the whole window (here 2 ms) and then sleeps; not
    begun (waiting behind a model step), it stops looking after 50 us."""
    worker, device = rig(begun=begun, completion_poll_us=2000 if begun else 10_000_000)
    handle = worker.submit(store())
    # 50 ms: past the window, and far past 50 us
    slept = await thread_seen_while_waiting(worker, device, handle, lambda: anyio.sleep(0.05))
    assert slept, "the waiter stopped looking and slept on the thread"
    assert handle.done()
    worker.close()


async def test_a_long_copy_goes_to_the_thread_at_once() -> None:
    worker, device = rig(completion_poll_us=10_000_000)
    worker._poll_max_pages = 2  # this rig's one block is 2 pages: "long"
    handle = worker.submit(store())
    assert not handle._poll
    # with a 10 s window the thread runs after two turns only if the copy is not polled
    assert await thread_seen_while_waiting(worker, device, handle, two_turns)
    worker.close()


@pytest.mark.parametrize("poll_us", [200, 0])
async def test_a_later_copy_seen_done_first_is_not_finished_before_the_earlier(
    poll_us: int,
) -> None:
    """The device reports the later copy done first: it is not finished (no result)
    until the earlier one is, and the waiters return in submission order."""
    worker, device = rig(completion_poll_us=poll_us)
    first = worker.submit(store(3, 1))
    second = worker.submit(store(4, 2))
    order: list[int] = []
    second_early: list[bool] = []

    async def waits(handle: Any) -> None:
        result = await worker.wait(handle)
        order.append(result.transfer_id)

    async def device_ends() -> None:
        await finish_after(device.copies[1], turns=2)
        await anyio.sleep(0.01)
        second_early.append(second.done())
        device.copies[0].finish()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waits, first)
            tg.start_soon(waits, second)
            tg.start_soon(device_ends)
    assert second_early == [False]
    assert order == [first.transfer_id, second.transfer_id]
    worker.close()


async def test_drain_and_unclaimed_results_need_no_waiter_of_their_own() -> None:
    worker, device = rig()
    handles = [worker.submit(store(b, s)) for b, s in ((3, 1), (5, 2))]
    assert not thread_started(worker)

    async def device_ends() -> None:
        await anyio.sleep(0.02)
        for copy in device.copies:
            copy.finish()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device_ends)
            await worker.drain()  # sleeps: the copies are handed to the thread
    assert thread_started(worker) and worker.num_in_flight == 0
    ids = [r.transfer_id for r in worker.get_finished()]
    assert ids == [h.transfer_id for h in handles]
    worker.close()
    # without any waiter or drain: reaped by the next look, no thread needed
    worker, device = rig()
    handle = worker.submit(store())
    device.copies[0].finish()
    assert [r.transfer_id for r in worker.get_finished()] == [handle.transfer_id]
    assert not thread_started(worker)


@pytest.mark.parametrize("bad", [-1, True, "200", float("inf"), float("nan"), None])
def test_completion_poll_us_must_be_a_non_negative_number(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"completion_poll_us: .* must be a number"):
        _worker(completion_poll_us=bad)


def test_completion_poll_us_takes_ints_and_floats() -> None:
    assert _worker(completion_poll_us=0)._poll_max_pages == 0
    assert _worker(completion_poll_us=12.5)._poll_seconds == pytest.approx(12.5e-6)
