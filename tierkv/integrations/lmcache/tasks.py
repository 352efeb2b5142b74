"""LMCache's task protocol: a task id per submit, one result per task, an event fd
signalled when results are ready.

LMCache's controllers poll the three event fds an adapter hands them (store, lookup
and lock, load: three distinct fds), and on a signal ask for the results
(`pop_completed_store_tasks`, `query_lookup_and_lock_result(id)`,
`query_load_result(id)`), each result given exactly once. `Completions` is one kind
of task's side of that: results put from tierkv's loop thread (or at once, from the
submitting thread, for a task that fails before it starts), taken from LMCache's
threads, under one lock. `Parts` finishes a task split over several tier chains
when its last part ends. Imports nothing of LMCache (the notifier is handed in).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Completions", "Notifier", "Parts", "TaskIds"]

R = TypeVar("R")


class Notifier(Protocol):
    """An event fd (LMCache's `EventNotifier`)."""

    def fileno(self) -> int: ...
    def notify(self) -> None: ...
    def close(self) -> None: ...


class TaskIds:
    """Task ids, unique across the three kinds of one adapter, from any thread."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return next(self._next)


class Completions(Generic[R]):
    """Results of one kind of task until taken, and the event fd that says so."""

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier
        self._lock = threading.Lock()
        self._results: dict[int, R] = {}
        self._closed = False

    def fileno(self) -> int:
        return self._notifier.fileno()

    def put(self, task_id: int, result: R) -> None:
        """Record a task's result and signal the fd (dropped after `close`)."""
        with self._lock:
            if self._closed:
                return
            self._results[task_id] = result
            self._notifier.notify()

    def take(self, task_id: int) -> R | None:
        """The task's result, once; None while it runs (and after it was taken)."""
        with self._lock:
            return self._results.pop(task_id, None)

    def take_all(self) -> dict[int, R]:
        with self._lock:
            taken, self._results = self._results, {}
            return taken

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._results.clear()
            self._notifier.close()


class Parts:
    """A task split in `count` parts: `finish` runs once, when the last part is done
    (on whichever thread ends it)."""

    def __init__(self, count: int, finish: Callable[[], None]) -> None:
        self._left = count
        self._finish = finish
        self._lock = threading.Lock()
        if count <= 0:
            finish()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()
