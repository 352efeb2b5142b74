"""`EngineJobs`: the jobs an engine's thread submitted and an adapter's loop thread
runs, each ended exactly once, and a drain that is bounded.

Engines submit jobs from their own threads and poll for results (vLLM's
`get_finished_jobs`); the tier runs them on the adapter's `LoopThread`. Whatever ends
a job first (its result, a refusal, a cancelled drain, shutdown) reports it; later
attempts find it gone. `drain` waits for every job under a timeout, cancels what is
left, and refuses to return while a job may still write into the engine's memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import anyio

from tierkv.driver.loop_thread import LoopThread

__all__ = ["EngineJobs"]

logger = logging.getLogger(__name__)

R = TypeVar("R")
"""What the adapter keeps of an open job (its keys, its size, ...)."""


class EngineJobs(Generic[R]):
    """Open jobs by id, shared by the engine's threads and the loop thread."""

    def __init__(self, loop: LoopThread, name: str) -> None:
        self._loop = loop
        self._name = name
        self.lock = threading.Condition()
        """Guards the job table; an adapter may guard its own result queue with it."""
        self._open: dict[int, R] = {}
        self._reporting = 0  # ended, result not yet published
        self._scopes: dict[int, anyio.CancelScope] = {}  # running jobs (loop thread)

    def add(self, job_id: int, record: R) -> None:
        with self.lock:
            self._open[job_id] = record

    @contextmanager
    def ending(self, job_id: int) -> Iterator[R | None]:
        """End `job_id`: yields its record (None when something ended it first);
        publish its result inside the block, so a drain never sees it neither open
        nor reported."""
        with self.lock:
            record = self._open.pop(job_id, None)
            if record is not None:
                self._reporting += 1
        try:
            yield record
        finally:
            if record is not None:
                with self.lock:
                    self._reporting -= 1
                    self.lock.notify_all()

    def pending(self) -> bool:
        with self.lock:
            return bool(self._open) or self._reporting > 0

    @contextmanager
    def cancellable(self, job_id: int) -> Iterator[anyio.CancelScope]:
        """Loop thread: run a job inside this so `drain` can cancel it."""
        scope = anyio.CancelScope()
        self._scopes[job_id] = scope
        try:
            with scope:
                yield scope
        finally:
            self._scopes.pop(job_id, None)

    def drain(self, timeout: float, grace: float, fail: Callable[[int, str], None]) -> None:
        """Wait up to `timeout` for every open job; cancel those left and give them
        `grace` to report. If the loop thread is gone nothing can end them: `fail`
        reports each at once. A job that outlives even that (a thread stuck in the
        kernel) raises RuntimeError: returning while it may still write into the
        engine's memory would corrupt it silently."""
        late = self.wait(timeout)
        if not late:
            return
        logger.warning(
            "tierkv tier %s: %d jobs still running after drain_timeout=%gs; cancelling them",
            self._name,
            len(late),
            timeout,
        )
        self._cancel(late)
        stuck = self.wait(grace)
        if not stuck:
            return
        if not self._loop.is_alive():
            for job_id in stuck:
                fail(job_id, "the tier's event-loop thread is gone")
            return
        raise RuntimeError(
            f"tierkv tier {self._name}: {len(stuck)} jobs did not end within "
            f"drain_timeout={timeout:g}s + shutdown_grace={grace:g}s even when cancelled "
            "(I/O stuck in the kernel?); "
            "not returning while they may still write into the engine's memory"
        )

    def wait(self, timeout: float) -> list[int]:
        """Wait until no job is pending, `timeout` passed or the loop thread died;
        the jobs still open."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while (self._open or self._reporting) and self._loop.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.05))
            return list(self._open)

    def open_ids(self) -> list[int]:
        with self.lock:
            return list(self._open)

    def _cancel(self, job_ids: list[int]) -> None:
        def cancel() -> None:
            for job_id in job_ids:
                scope = self._scopes.get(job_id)
                if scope is not None:
                    scope.cancel()

        if self._loop.is_alive():
            self._loop.loop.call_soon_threadsafe(cancel)
