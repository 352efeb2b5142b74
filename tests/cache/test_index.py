"""The per-key index: locations as tier bits, failed claims, the dirty set, bounds."""

from __future__ import annotations

from tierkv.cache.index import Flight, KeyIndex, lowest_bit

A, B, C, D = (bytes([c]) * 8 for c in b"ABCD")


def test_location_is_the_highest_tier_believed_to_hold_the_key() -> None:
    index = KeyIndex(limit=16)
    assert index.location(A) is None
    index.note_held([A], 2)
    index.note_held([A], 1)
    assert index.location(A) == 1
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
    index.clean(B, 0)
    assert index.is_dirty(B)  # still owed to tier 1
    index.clean(B, 1)
    assert index.is_clean(B) and index.dirty_keys() == [A]


def test_idle_states_are_forgotten_past_the_limit_busy_ones_are_kept() -> None:
    index = KeyIndex(limit=2)
    index.mark_dirty(A, 1)  # busy: dirty
    index.state(B).flight = Flight(keys=[B])  # busy: promoting
    index.note_held([C], 0)
    index.note_held([D], 0)
    assert index.get(A) is not None and index.get(B) is not None
    assert index.get(C) is None  # the oldest idle state went first
    assert len(index) <= 3
