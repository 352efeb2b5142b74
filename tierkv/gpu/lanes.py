"""Completion lanes: one per direction, each with its stream, its transfers in flight
(oldest first) and a completion thread that sleeps on the copies' end events and then
wakes the event loop (`notify`, which the worker turns into
`loop.call_soon_threadsafe`). A copy is handed to the thread only when a task is about
to sleep until it is done (`Lane.watch_all`): waking that thread at every submission
cost a one-block load ~50 us of its submit (the GIL handed to it and back), and a
short copy's waiter looks at it from the loop before it sleeps
(`TransferWorker(..., completion_poll_us=)`).

Copies of one lane run on one stream, so they finish in submission order; the thread
waits on them in that order. A lane holds `TransferHandle`s: a submitted transfer, as
the worker hands it to its caller, with what the lane needs to finish it (`Launched`:
its completion and the buffers to keep alive until then).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from tierkv.gpu.spec import DIRECTIONS, Direction, TransferResult
from tierkv.gpu.streams import Completion, Streams

logger = logging.getLogger(__name__)


IDLE_EXIT = 5.0
"""Seconds a completion thread stays with nothing to watch before it exits (the next
`watch` starts a new one), so idle workers hold no threads."""


class CompletionThread:
    """Waits on completions, in the order given, and calls `notify()` after each.

    Started by `watch` when none runs; a daemon thread that exits after `IDLE_EXIT`
    seconds with nothing to watch, so a worker nobody closes keeps neither a thread nor
    the interpreter alive. `close` lets it finish what it was given and stop."""

    def __init__(self, name: str, notify: Callable[[], None]) -> None:
        self._name = name
        self._notify = notify
        self._queue: queue.SimpleQueue[Completion | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, completion: Completion) -> None:
        with self._lock:  # under the lock: an exiting thread sees the new item
            self._queue.put(completion)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _next(self) -> Completion | None:
        """The next completion to wait on, or None when this thread should exit
        (`close` asked, or nothing came for `IDLE_EXIT` seconds)."""
        while True:
            try:
                item = self._queue.get(timeout=IDLE_EXIT)
            except queue.Empty:
                item = None
            if item is not None:
                return item
            with self._lock:  # idle, or a stop request: exit unless work arrived since
                if self._queue.empty():
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return None

    def _run(self) -> None:
        while True:
            completion = self._next()
            if completion is None:
                return
            try:
                completion.wait()
            except Exception:  # a device error: the loop side sees it in query()
                logger.exception("%s: waiting on a copy failed", self._name)
            try:
                self._notify()
            except Exception:
                logger.exception("%s: waking the event loop failed", self._name)

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)


@dataclass(eq=False)
class TransferHandle:
    """A submitted transfer. `result` is set once its copy is complete; `done_event`
    (CUDA) is the event that closes the copy: an engine stream that waits on it sees
    the copied bytes, so the model can be enqueued before the copy has finished."""

    transfer_id: int
    direction: Direction
    num_blocks: int
    num_bytes: int
    backend: str
    done_event: Any = None
    result: TransferResult | None = None
    _completion: Completion | None = field(default=None, repr=False)
    _keepalive: tuple[object, ...] = field(default=(), repr=False)
    _claimed: bool = field(default=False, repr=False)
    _wakeup: anyio.Event | None = field(default=None, repr=False)
    _watched: bool = field(default=False, repr=False)  # handed to the completion thread
    _poll: bool = field(default=False, repr=False)  # its waiter looks from the loop first

    def done(self) -> bool:
        return self.result is not None


@dataclass(frozen=True)
class Launched:
    """What `_launch` started: how to tell it is done, what to keep alive until then,
    and which backend moves the bytes."""

    completion: Completion
    keepalive: tuple[object, ...]
    backend: str


@dataclass
class Lane:
    """One direction: its stream (None on CPU), transfers in flight oldest first,
    the handles being awaited in submission order, its completion thread, and the
    one-at-a-time thread large transfers are issued from (`TransferWorker.start`)."""

    stream: Any
    completions: CompletionThread
    in_flight: deque[TransferHandle] = field(default_factory=deque)
    waiters: list[TransferHandle] = field(default_factory=list)
    # held while a copy is queued and added to in_flight, so that stream order and
    # in_flight order agree when the submitter thread and the caller both launch
    launching: threading.Lock = field(default_factory=threading.Lock)
    submitter: Any = None  # anyio.CapacityLimiter(1): this lane's submitter thread

    def watch_all(self) -> None:
        """Hand every copy in flight that its completion thread does not watch yet to
        it, oldest first: a task about to sleep until a copy is done needs the thread
        to wake it. On the event loop thread; the submitter thread may append
        meanwhile (`list` of a deque is one step under the GIL)."""
        for handle in list(self.in_flight):
            if not handle._watched and handle._completion is not None:
                handle._watched = True
                self.completions.watch(handle._completion)

    def reap(self, unclaimed: Callable[[TransferResult], None]) -> None:
        """Finish, in order, every transfer at the head whose copy is complete (set
        its result, let go of its completion and buffers; `unclaimed` gets the results
        nobody awaits), then wake the first waiter if its transfer is done. On the
        event loop thread (`TransferWorker._reap`)."""
        while self.in_flight:
            handle = self.in_flight[0]
            assert handle._completion is not None
            if not handle._completion.query():
                break
            self.in_flight.popleft()
            handle.result = TransferResult(
                handle.transfer_id,
                handle.direction,
                handle.num_blocks,
                handle.num_bytes,
                handle._completion.seconds(),
                handle.backend,
            )
            handle._completion, handle._keepalive = None, ()
            if not handle._claimed:
                unclaimed(handle.result)
        if self.waiters and self.waiters[0].done() and self.waiters[0]._wakeup:
            self.waiters[0]._wakeup.set()


def new_lanes(streams: Streams, notify: Callable[[], None]) -> dict[Direction, Lane]:
    """One lane per direction, each on a new stream of `streams` with its own
    completion thread (not started until a copy is watched) that calls `notify`."""
    return {
        d: Lane(streams.new_stream(), CompletionThread(f"tierkv-{d}-completion", notify))
        for d in DIRECTIONS
    }
