"""Waiting for room in the primary, woken only when room one can use is released.

Stores and promotions compete for the primary's slots. When one finds no room, it
waits here with the number of slots it `need`s. A release (a slot freed, a block
becoming evictable, a promotion's share given back) wakes waiters in order, first
promotions (a load is on the request's critical path), then stores, each only while
the room released so far covers its need: a waiter that cannot use a release is not
woken by it, and two waiters are not both woken for the same slot. A waiter woken
whose room was then vetoed (a dirty block, a block of its own request) simply waits
again.

Pure bookkeeping on the event loop thread: the owner (`PrimaryTier`) says how much
room each kind has when it calls `wake`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import anyio


class Kind(Enum):
    """Who waits: promotions are woken before stores."""

    PROMOTION = "promotion"
    STORE = "store"


@dataclass(eq=False, slots=True)
class _Waiter:
    need: int
    event: anyio.Event = field(default_factory=anyio.Event)


class RoomWaiters:
    """FIFO queues of tasks waiting for primary room, one per `Kind`."""

    def __init__(self) -> None:
        self._queues: dict[Kind, deque[_Waiter]] = {kind: deque() for kind in Kind}
        self.wakeups = 0  # waiters woken so far (each for room it could use)

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def waiting(self, kind: Kind) -> int:
        return len(self._queues[kind])

    def wake(self, room: dict[Kind, int]) -> None:
        """Wake, in order, the waiters whose need the `room` of their kind covers; the
        room one takes is not offered to the next. A queue stops at its first waiter
        that does not fit (first come, first served: a large need is not starved by
        small ones behind it)."""
        for kind in Kind:
            queue = self._queues[kind]
            left = room.get(kind, 0)
            while queue and queue[0].need <= left:
                waiter = queue.popleft()
                left -= waiter.need
                waiter.event.set()
                self.wakeups += 1

    async def wait(self, kind: Kind, need: int, timeout: float, *, again: bool = False) -> bool:
        """Wait up to `timeout` seconds to be woken for `need` slots of room. True when
        woken (the room may be taken by then: check again), False on timeout. A
        waiter woken before whose room was then refused waits `again`, at the front:
        it keeps its turn."""
        if timeout <= 0:
            return False
        waiter = _Waiter(max(1, need))
        queue = self._queues[kind]
        if again:
            queue.appendleft(waiter)
        else:
            queue.append(waiter)
        try:
            with anyio.move_on_after(timeout):
                await waiter.event.wait()
        finally:
            if not waiter.event.is_set():
                queue.remove(waiter)  # timed out or cancelled: leave the queue
        return waiter.event.is_set()
