"""The sighting sketch and the reuse admission rule (tierkv.policies.admission)."""

from __future__ import annotations

import os
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tierkv.policies.admission import ReuseAdmission, SightingSketch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.binary(min_size=1, max_size=24), max_size=12), max_size=30))
def test_the_sketch_never_undercounts(batches: list[list[bytes]]) -> None:
    sketch = SightingSketch(width_bits=6, depth=2)  # tiny: collisions are common
    truth: Counter[bytes] = Counter()
    for batch in batches:
        distinct = list(dict.fromkeys(batch))
        returned = sketch.add(distinct)
        truth.update(distinct)
        assert all(r >= min(truth[k], 255) for k, r in zip(distinct, returned.tolist()))
    keys = list(truth)
    assert all(e >= min(truth[k], 255) for k, e in zip(keys, sketch.estimate(keys).tolist()))


def test_a_wide_sketch_counts_exactly_for_few_keys() -> None:
    sketch = SightingSketch(width_bits=16)
    keys = [os.urandom(20) for _ in range(200)]
    for n in range(3):
        sketch.add(keys[: 100 + 50 * n])
    assert sketch.estimate(keys[:100]).tolist() == [3] * 100
    assert sketch.estimate(keys[150:200]).tolist() == [1] * 50
    assert sketch.estimate([os.urandom(20)]).tolist() == [0]


def test_counts_saturate_and_age() -> None:
    sketch = SightingSketch(width_bits=4, depth=1)
    key = b"k"
    for _ in range(300):  # reset_every = 10 x 16: halved after 160 additions, then 80 more
        sketch.add([key])
    assert sketch.halvings == 2
    assert int(sketch.estimate([key])[0]) == 80 + 60
    wide = SightingSketch(width_bits=8, depth=1)  # halves after 2,560 additions
    for _ in range(300):
        wide.add([key])
    assert int(wide.estimate([key])[0]) == 255  # 8-bit counters stop, never wrap
    assert sketch.nbytes == 16


def test_bad_sketch_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="width_bits"):
        SightingSketch(width_bits=40)
    with pytest.raises(ValueError, match="depth"):
        SightingSketch(depth=0)


def test_a_block_seen_once_is_declined_and_seen_twice_admitted() -> None:
    admission = ReuseAdmission(width_bits=16)
    keys = [os.urandom(20) for _ in range(8)]
    admission.sighted(keys, tail=keys)  # a miss: first sight of all
    assert admission.admits(keys) == [False] * 8
    admission.sighted(keys[:4], tail=keys[:4])  # seen again (evicted: a miss again)
    assert admission.admits(keys) == [True] * 4 + [False] * 4


def test_a_continuing_request_admits_its_new_tail_on_first_sight() -> None:
    admission = ReuseAdmission(width_bits=16)
    turn1 = [os.urandom(20) for _ in range(6)]
    admission.sighted(turn1, tail=turn1)
    turn2 = [*turn1, *(os.urandom(20) for _ in range(4))]
    admission.sighted(turn2, tail=turn2[6:])  # hit 6 of 10: continuing
    assert admission.admits(turn2[6:]) == [True] * 4
    other = [os.urandom(20) for _ in range(10)]
    admission.sighted(other, tail=other[4:])  # hit 4 of 10: a shared prefix, not a turn
    assert admission.admits(other[4:]) == [False] * 6


def test_the_continuing_set_is_bounded() -> None:
    admission = ReuseAdmission(width_bits=16, max_continuing=5)
    for _ in range(4):
        keys = [os.urandom(20) for _ in range(4)]
        admission.sighted(keys, tail=keys[2:])
    assert len(admission._continuing) == 5
