"""How the worker orders and times its copies: CUDA streams and events, or nothing at
all on the CPU device, behind one small interface (`Streams`) that the tests also
implement with a fake device to drive ordering and completion on CPU.

The ordering contract: a transfer starts only after the `ready` the engine gives (a
stream: everything queued on it when the transfer is submitted; an event: that event),
never after "the current stream of the calling thread", which in an asyncio server is
the loop thread's stream, not the one the model writes KV on. A transfer ends with an
event (`Completion.event`) the engine's stream can wait on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tierkv.gpu.driver_calls import DriverEvents, load_driver_events

Work = Callable[[Any], None]
"""Enqueues a copy on the given stream (None on the CPU device)."""


class Completion(Protocol):
    """When a launched copy is done, and how long it took."""

    @property
    def event(self) -> Any:
        """What an engine stream waits on to see the copy's result (None on CPU)."""
        ...

    def query(self) -> bool: ...

    def started(self) -> bool:
        """Whether the copy has begun on its stream (it may still wait behind `ready`
        or an earlier copy); a waiter stops looking at one that has not."""
        ...

    def wait(self) -> None:
        """Block the calling thread (a completion thread) until the copy is done."""
        ...

    def seconds(self) -> float: ...


class Streams(Protocol):
    """Streams and events of one device."""

    asynchronous: bool
    """False: `launch` runs the copy before returning (the CPU device)."""

    def new_stream(self) -> Any: ...

    def order_after(self, stream: Any, ready: Any) -> None:
        """Make work enqueued later on `stream` wait for `ready` (a stream or event)."""
        ...

    def launch(self, stream: Any, work: Work, *, current: bool = True) -> Completion:
        """Enqueue `work` on `stream` between a start and an end event. `current`:
        make `stream` the current stream while `work` runs (work that launches torch
        kernels or allocates needs it; work that passes the stream handle itself, like
        the batched memcpy, does not, and skips its cost)."""
        ...


def is_stream(ready: Any) -> bool:
    """Streams record events; events do not (torch and the test fakes alike)."""
    return hasattr(ready, "record_event")


class Finished:
    """CPU: the copy ran inside `launch`."""

    event = None

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def query(self) -> bool:
        return True

    def started(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def seconds(self) -> float:
        return self._seconds


class ImmediateStreams:
    """The CPU device: no streams, every copy runs at once on the calling thread."""

    asynchronous = False

    def new_stream(self) -> None:
        return None

    def order_after(self, stream: Any, ready: Any) -> None:
        return None  # CPU tensors have no queued writers

    def launch(self, stream: Any, work: Work, *, current: bool = True) -> Completion:
        start = time.perf_counter()
        work(None)
        return Finished(time.perf_counter() - start)


class CudaCompletion:
    """A copy between two CUDA events; `wait` sleeps in the driver (blocking-sync
    events) rather than spinning a core."""

    def __init__(
        self,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        reuse_start: Callable[[torch.cuda.Event], None] | None = None,
        events: Callable[[], DriverEvents | None] | None = None,
    ) -> None:
        self._start: torch.cuda.Event | None = start
        self._end = end
        self._reuse_start = reuse_start
        self._events = events  # the driver's event calls, where this thread may use them
        self._seconds: float | None = None

    @property
    def event(self) -> torch.cuda.Event:
        return self._end

    def query(self) -> bool:
        driver = self._events() if self._events is not None else None
        if driver is not None:
            return driver.query(self._end)
        return bool(self._end.query())  # type: ignore[no-untyped-call]

    def started(self) -> bool:
        """The start event, recorded just before the copy on its stream, is reached."""
        start = self._start
        if start is None:  # timed already: the copy is done
            return True
        driver = self._events() if self._events is not None else None
        if driver is not None:
            return driver.query(start)
        return bool(start.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._end.synchronize()

    def seconds(self) -> float:
        """The copy's duration; once read (the copy is done), the start event, which
        nothing else holds, goes back to the pool."""
        if self._seconds is None:
            assert self._start is not None
            self._seconds = float(self._start.elapsed_time(self._end)) / 1000.0
            start, self._start = self._start, None
            if self._reuse_start is not None:
                self._reuse_start(start)
        return self._seconds


START_EVENTS_KEPT = 64
"""Start events kept for reuse: creating and recording a timing event pair cost ~15 us
of host time on an H100 (`benchmarks/gpu_one_block.py`), a one-block load's largest
share. End events are handed to the engine (`done_event`) and are never reused."""


class CudaStreams:
    """One CUDA device. CUDA only."""

    asynchronous = True

    def __init__(self, device: torch.device, driver: DriverEvents | None = None) -> None:
        """`driver`: event calls through the CUDA driver (`tierkv.gpu.driver_calls`;
        default: loaded where cuda-bindings serves them, else torch's calls)."""
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._starts: list[torch.cuda.Event] = []
        self._marks: dict[int, torch.cuda.Event] = {}  # per ordered stream (its handle)
        self._driver = driver if driver is not None else load_driver_events()
        self._driver_threads: set[int] = set()

    def _events(self, here: bool | None = None) -> DriverEvents | None:
        """The driver's event calls where this thread may make them, else None (the
        caller uses torch's). The driver acts on the thread's current context: only
        where this device is the thread's current one (`here`, when the caller
        knows) and torch has made one of these calls on the thread before, which made
        the device's context current there (the first call on a thread goes through
        torch)."""
        driver = self._driver
        if driver is None:
            return None
        if here is None:
            here = torch.cuda.current_device() == self._index
        if not here:
            return None
        thread = threading.get_ident()
        if thread in self._driver_threads:
            return driver
        self._driver_threads.add(thread)  # after this call's torch call
        return None

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def order_after(self, stream: Any, ready: Any) -> None:
        """After a `ready` stream: record one event per ordered stream on it, each time
        again, and wait on that. A wait holds the event's record as of the call, so
        re-recording it later orders nothing wrongly; `wait_stream` made a new event
        every time (a one-block transfer's host time)."""
        driver = self._events()
        if is_stream(ready):
            mark = self._marks.get(stream.cuda_stream)
            if mark is None:
                mark = self._marks[stream.cuda_stream] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            if driver is None:
                mark.record(ready)
                stream.wait_event(mark)
            else:
                driver.record(mark, ready)
                driver.wait(stream, mark)
        elif driver is not None and isinstance(ready, torch.cuda.Event):
            driver.wait(stream, ready)
        else:
            stream.wait_event(ready)

    def launch(self, stream: Any, work: Work, *, current: bool = True) -> Completion:
        # Every tensor allocated by `work` is allocated on `stream` (when `current`), so
        # the caching allocator reuses its memory only for later work on that stream.
        # Both context managers cost microseconds of a one-block transfer's host time:
        # entered only where needed.
        here = torch.cuda.current_device() == self._index
        if not current and here:
            return self._launch(stream, work, self._events(here))
        with contextlib.ExitStack() as contexts:
            if not here:
                contexts.enter_context(torch.cuda.device(self.device))
            if current:
                contexts.enter_context(torch.cuda.stream(stream))
            return self._launch(stream, work, None)

    def _launch(self, stream: Any, work: Work, driver: DriverEvents | None) -> CudaCompletion:
        start = self._pooled_start()
        end = _timing_event()
        if driver is not None:
            driver.record(start, stream)  # pooled (or new: then through torch)
        else:
            start.record(stream)
        work(stream)
        end.record(stream)  # new: torch creates it here
        return CudaCompletion(start, end, self._reuse_start, self._events)

    def _pooled_start(self) -> torch.cuda.Event:
        try:
            return self._starts.pop()  # both lanes may launch at once: pop, not test-then-pop
        except IndexError:
            return _timing_event()

    def _reuse_start(self, event: torch.cuda.Event) -> None:
        if len(self._starts) < START_EVENTS_KEPT:
            self._starts.append(event)  # list append/pop: atomic under the GIL


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]
