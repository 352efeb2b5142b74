"""The shared state: the `Signal` that wakes waiters, and the `EventLog`, which is the
primary's event sink (no caller has to collect the primary's events)."""

from __future__ import annotations

import anyio
import pytest

from tierkv.cache.core import EventLog, Signal
from tierkv.contract.events import OffloadingEvent
from tierkv.primary import PrimaryTier

pytestmark = pytest.mark.anyio

A, B, C = (bytes([c]) * 8 for c in b"ABC")


async def test_a_signal_wakes_every_waiter_and_counts_them() -> None:
    signal = Signal()
    woke: list[int] = []

    async def waiter(n: int) -> None:
        await signal.wait()
        woke.append(n)

    signal.notify()  # nobody waits: nothing to wake, nothing remembered
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 1)
        tg.start_soon(waiter, 2)
        await anyio.sleep(0)
        assert signal.waiting == 2 and woke == []
        signal.notify()
    assert sorted(woke) == [1, 2] and signal.waiting == 0


async def test_a_waiter_that_gives_up_is_no_longer_counted() -> None:
    signal = Signal()
    with anyio.move_on_after(0.01):
        await signal.wait()
    assert signal.waiting == 0


def test_the_primary_events_reach_the_log_as_they_happen_in_order() -> None:
    primary = PrimaryTier(2, 64, pin_memory=False)
    log = EventLog(primary)
    for key in (A, B, C):  # C evicts A
        prepared = primary.prepare_store([key])
        assert prepared is not None
        primary.complete_store(prepared.keys_to_store)
    log.emit([OffloadingEvent((C,), "nvme", removed=False)])  # a tier's, after
    assert log.take() == [
        OffloadingEvent((A,), "cpu", removed=False),
        OffloadingEvent((B,), "cpu", removed=False),
        OffloadingEvent((A,), "cpu", removed=True),
        OffloadingEvent((C,), "cpu", removed=False),
        OffloadingEvent((C,), "nvme", removed=False),
    ]
    assert primary.take_events() == [] and log.take() == []


def test_the_log_keeps_the_newest_events_and_counts_the_dropped() -> None:
    primary = PrimaryTier(4, 64, pin_memory=False)
    log = EventLog(primary, limit=2)
    for key in (A, B, C):
        prepared = primary.prepare_store([key])
        assert prepared is not None
        primary.complete_store(prepared.keys_to_store)
    assert [e.keys for e in log.take()] == [(B,), (C,)] and log.dropped == 1
