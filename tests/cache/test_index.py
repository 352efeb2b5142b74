"""The per-key index: locations as tier bits, failed claims, the dirty set, cascades,
hits once per request, flights, and the bound."""

from __future__ import annotations

import anyio
import pytest

from tierkv.cache.index import Flight, KeyIndex, lowest_bit

A, B, C, D = (bytes([c]) * 8 for c in b"ABCD")


def test_location_is_the_highest_tier_believed_to_hold_the_key() -> None:
    index = KeyIndex(limit=16)
    assert index.location(A) is None
    index.note_held([A], 2)
    index.note_held([A], 1)
    assert index.location(A) == 1 and index.held(A) == 0b110
    index.note_failed(A, 1)  # tier 1 could not serve it: not believed again
    assert index.location(A) == 2 and not index.believes(A, 1) and index.believes(A, 2)
    index.note_held([A], 1)  # stored there again: believed again
    assert index.location(A) == 1
    index.note_missing(A, 1)
    index.note_missing(A, 2)
    assert index.location(A) is None
    assert lowest_bit(0) is None and lowest_bit(0b1100) == 2


def test_the_dirty_set_tracks_each_tier_and_keeps_its_order() -> None:
    index = KeyIndex(limit=16)
    index.mark_dirty(B, 0b11)
    index.mark_dirty(A, 0b01)
    assert index.dirty_keys() == [B, A] and index.dirty_count == 2
    assert index.pending_for(B, 1) and not index.pending_for(A, 1)
    assert index.failed_write_back(B, 0) == 1 and index.failed_write_back(B, 0) == 2
    index.clean(B, 0)
    assert index.is_dirty(B)  # still owed to tier 1
    index.clean(B, 1)
    assert index.is_clean(B) and index.dirty_keys() == [A]
    assert index.failed_write_back(B, 0) == 1  # attempts were forgotten with the dirt


def test_fields_do_not_bleed_into_each_other() -> None:
    index = KeyIndex(limit=16)
    index.note_held([A], 15)
    index.mark_dirty(A, 1 << 15)
    index.add_cascading([A, A], 1)
    assert index.count_hit(A, None) == 1
    assert (index.location(A), index.cascading(A), index.hits(A)) == (15, 2, 1)
    assert index.pending_for(A, 15) and not index.pending_for(A, 14)
    index.add_cascading([A, A, A], -1)  # never below zero
    assert index.cascading(A) == 0 and index.location(A) == 15 and index.hits(A) == 1


def test_hits_count_once_per_request() -> None:
    index = KeyIndex(limit=16)
    assert index.count_hit(A, "r1") == 1
    assert index.count_hit(A, "r1") is None
    assert index.count_hit(A, "r2") == 2
    assert index.count_hit(A, None) == 3 and index.count_hit(A, None) == 4


def test_idle_entries_are_forgotten_past_the_limit_busy_ones_are_kept() -> None:
    index = KeyIndex(limit=2)
    index.mark_dirty(A, 1)  # busy: dirty
    flight = Flight(keys=[B])
    index.set_flight(B, flight)  # busy: promoting
    index.note_held([C], 0)
    index.note_held([D], 0)
    assert A in index and B in index
    assert C not in index  # the oldest idle entry went first
    assert index.flight(B) is flight and index.promoting == 1
    index.end_flight(B, flight)
    assert index.flight(B) is None and index.promoting == 0


def test_with_hits_keeps_order_and_the_keys_at_the_threshold() -> None:
    index = KeyIndex(limit=16)
    for key, hits in ((A, 2), (B, 1), (C, 3)):
        for n in range(hits):
            index.count_hit(key, f"r{n}")
    assert index.with_hits([C, B, A, b"unknown-key"], 2) == [C, A]
    assert index.with_hits([C, B, A], 0)[-1] == A and len(index.with_hits([C, B, A, b"x"], 0)) == 4


def test_a_flight_counts_its_starter_and_the_waiters_that_join_or_leave() -> None:
    flight = Flight([A, B])
    assert A in flight and C not in flight
    assert flight.waiters(A) == 1 and flight.waiters(C) == 0  # whoever started it waits
    flight.join(A)
    flight.join(A)
    flight.leave(A)  # gave up before the window landed: no reader for it
    flight.leave(B)
    assert flight.waiting() == {A: 2}  # nobody waits on B any more


def test_a_landed_flight_grants_one_reader_per_waiter_on_each_key_it_read() -> None:
    flight = Flight([A, B, C])
    flight.join(A)
    flight.served(A, "nvme")
    flight.failed(B, "tier nvme could not load it")
    assert flight.read_keys() == ([A], [B, C])  # C: not answered yet
    assert not flight.landed
    flight.finish(flight.waiting())
    assert flight.landed
    assert flight.take(A) == "nvme" and flight.take(A) == "nvme"  # two waiters on A
    assert flight.take(A) is None  # no reader left for a third
    assert flight.take(B) is None and flight.error(B) == "tier nvme could not load it"
    assert flight.take(C) is None and flight.error(C) == "promotion cancelled"
    assert flight.waiters(A) == 2  # the count stays as it was when the window landed


@pytest.mark.anyio
async def test_waiting_on_a_flight_returns_once_it_lands() -> None:
    flight = Flight([A])
    woke: list[bool] = []

    async def waiter() -> None:
        await flight.wait()
        woke.append(flight.landed)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0)
        assert woke == []
        flight.finish({})
    assert woke == [True]
    assert flight.take(A) is None and flight.error(A) == "promotion cancelled"
