"""Completion threads: wait on each copy in order, wake the loop after each, exit when
idle or closed, and start again when new copies come."""

from __future__ import annotations

import threading

import pytest

from tierkv.gpu import lanes
from tierkv.gpu.lanes import CompletionThread


class Done:
    event = None

    def __init__(self) -> None:
        self.finished = threading.Event()

    def query(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> None:
        self.finished.wait()

    def seconds(self) -> float:
        return 0.0


def _thread(watcher: CompletionThread) -> threading.Thread:
    thread = watcher._thread
    assert thread is not None
    return thread


def test_notifies_once_per_copy_in_order_and_exits_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lanes, "IDLE_EXIT", 0.05)
    woken = threading.Semaphore(0)
    watcher = CompletionThread("test", woken.release)
    first, second = Done(), Done()
    watcher.watch(first)
    watcher.watch(second)
    second.finished.set()  # the thread is still waiting on the first
    assert not woken.acquire(timeout=0.05)
    first.finished.set()
    assert woken.acquire(timeout=5) and woken.acquire(timeout=5)
    thread = _thread(watcher)
    thread.join(timeout=5)
    assert not thread.is_alive() and watcher._thread is None  # idle: gone
    third = Done()
    third.finished.set()
    watcher.watch(third)  # a new thread picks it up
    assert woken.acquire(timeout=5)
    watcher.close(timeout=5)


def test_close_finishes_what_was_given_and_a_later_watch_still_runs() -> None:
    woken = threading.Semaphore(0)
    watcher = CompletionThread("test", woken.release)
    done = Done()
    done.finished.set()
    watcher.watch(done)
    thread = _thread(watcher)
    watcher.close(timeout=5)
    assert not thread.is_alive() and woken.acquire(timeout=5)
    later = Done()
    later.finished.set()
    watcher.watch(later)
    assert woken.acquire(timeout=5)
    watcher.close(timeout=5)
