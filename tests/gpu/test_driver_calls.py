"""Event calls through the CUDA driver (`tierkv.gpu.driver_calls`), on CPU: the
driver's entry points are stand-ins (Python callables with the same signatures), and
the events and streams carry the handles torch would expose. What is proven here is
which handles reach the driver, what an event torch never created does, and how the
driver's results read; on a GPU the worker's CUDA tests run through it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tierkv.gpu.driver_calls import (
    CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS,
    DriverEvents,
    driver_entry,
    load_driver_events,
)
from tierkv.gpu.streams import CudaStreams


class Event:
    """What the driver path reads of a torch event: its handle (0 until torch creates
    it at its first record), and torch's own record for that first one."""

    def __init__(self, handle: int = 0) -> None:
        self.cuda_event = handle
        self.torch_records: list[Any] = []

    def record(self, stream: Any) -> None:
        self.torch_records.append(stream)
        self.cuda_event = self.cuda_event or 77


class Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class Driver:
    """Stand-in entry points: record the calls, answer with `status`."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.status = CUDA_SUCCESS

    def record(self, event: int, stream: int) -> int:
        self.calls.append(("record", event, stream))
        return self.status

    def query(self, event: int) -> int:
        self.calls.append(("query", event))
        return self.status

    def wait(self, stream: int, event: int, flags: int) -> int:
        self.calls.append(("wait", stream, event, flags))
        return self.status

    def events(self) -> DriverEvents:
        return DriverEvents(self.record, self.query, self.wait)


def test_created_events_go_to_the_driver_by_their_handles() -> None:
    driver = Driver()
    events = driver.events()
    event, stream = Event(5), Stream(9)
    events.record(event, stream)
    events.wait(Stream(3), event)
    assert events.query(event)
    driver.status = CUDA_ERROR_NOT_READY
    assert not events.query(event)
    assert driver.calls == [("record", 5, 9), ("wait", 3, 5, 0), ("query", 5), ("query", 5)]
    assert event.torch_records == []


def test_an_event_torch_never_created_is_recorded_by_torch_and_orders_nothing() -> None:
    driver = Driver()
    events = driver.events()
    fresh = Event()
    assert events.query(fresh), "never recorded: done, as torch says"
    events.wait(Stream(3), fresh)  # nothing to wait for, as torch's wait_event
    assert driver.calls == []
    stream = Stream(9)
    events.record(fresh, stream)
    assert fresh.torch_records == [stream] and driver.calls == []
    events.record(fresh, stream)  # created now: the driver's
    assert driver.calls == [("record", 77, 9)]


@pytest.mark.parametrize("call", ["record", "query", "wait"])
def test_a_driver_error_is_raised_with_its_code(call: str) -> None:
    driver = Driver()
    driver.status = 400  # CUDA_ERROR_INVALID_HANDLE
    events = driver.events()
    event = Event(5)
    with pytest.raises(RuntimeError, match=r"failed with CUresult 400"):
        if call == "record":
            events.record(event, Stream(1))
        elif call == "query":
            events.query(event)
        else:
            events.wait(Stream(1), event)


def test_without_cuda_bindings_there_is_no_driver_path() -> None:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        assert driver_entry("cuEventRecord", object) is None
        assert load_driver_events() is None
    else:  # pragma: no cover - a machine with cuda-bindings and maybe no driver
        pytest.skip("cuda-bindings is installed here")


def test_a_thread_uses_the_driver_only_after_its_first_call_went_through_torch() -> None:
    """The driver acts on the thread's current context, which torch's first call on a
    thread makes current: each thread's first call is torch's, and a device that is
    not the thread's current one never gets the driver."""
    driver = Driver().events()
    streams = CudaStreams(torch.device("cuda", 0), driver=driver)
    assert streams._events(here=True) is None, "first call on this thread: torch's"
    assert streams._events(here=True) is driver
    assert streams._events(here=False) is None, "another device is current"
    seen: list[Any] = []
    thread = threading.Thread(
        target=lambda: seen.extend([streams._events(here=True), streams._events(here=True)])
    )
    thread.start()
    thread.join()
    assert seen == [None, driver]
    assert CudaStreams(torch.device("cuda", 0), driver=None)._events(here=True) is None


def test_the_ctypes_signatures_carry_64_bit_handles() -> None:
    """The entry points' ctypes signatures, driven through C callbacks: handles above
    4 GiB arrive whole (user-space pointers are 64-bit), flags as 0."""
    from tierkv.gpu import driver_calls

    driver = Driver()
    events = DriverEvents(
        driver_calls._HANDLES_2(driver.record),
        driver_calls._HANDLE_1(driver.query),
        driver_calls._WAIT(driver.wait),
    )
    event, stream = Event(0x7F12_3456_7890), Stream(0x7F00_0000_0010)
    events.record(event, stream)
    events.wait(stream, event)
    assert events.query(event)
    assert driver.calls == [
        ("record", 0x7F12_3456_7890, 0x7F00_0000_0010),
        ("wait", 0x7F00_0000_0010, 0x7F12_3456_7890, 0),
        ("query", 0x7F12_3456_7890),
    ]
