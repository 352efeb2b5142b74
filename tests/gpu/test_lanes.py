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


class CountedDone(Done):
    """Done after `after` looks; counts the looks and the sleeping waits."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.looks = 0
        self.waits = 0

    def query(self) -> bool:
        self.looks += 1
        if self.looks >= self.after:
            self.finished.set()
        return super().query()

    def wait(self) -> None:
        self.waits += 1
        super().wait()


@pytest.mark.parametrize(("spin", "after", "looks"), [(0.0, 3, 0), (5.0, 3, 3)])
def test_a_spinning_thread_looks_until_done_then_still_waits_and_notifies(
    spin: float, after: int, looks: int
) -> None:
    woken = threading.Semaphore(0)
    watcher = CompletionThread("test", woken.release, spin=spin)
    done = CountedDone(after)
    if not spin:
        done.finished.set()  # no looks: the thread sleeps on it at once
    watcher.watch(done)
    assert woken.acquire(timeout=5)
    assert (done.looks, done.waits) == (looks, 1)
    watcher.close(timeout=5)


def test_a_spin_gives_up_at_its_deadline_and_sleeps_on_the_copy() -> None:
    woken = threading.Semaphore(0)
    watcher = CompletionThread("test", woken.release, spin=0.01)
    done = CountedDone(after=10**9)  # never done by looking
    watcher.watch(done)
    assert not woken.acquire(timeout=0.1), "still waiting after the spin"
    assert done.looks >= 1 and done.waits == 1
    done.finished.set()
    assert woken.acquire(timeout=5)
    watcher.close(timeout=5)
