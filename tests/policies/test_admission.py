"""The sighting sketch and the reuse admission rule (tierkv.policies.admission)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tierkv.policies.admission import MIN_AGING_PERIOD, ReuseAdmission, SightingSketch


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


def test_estimates_are_the_same_in_every_process() -> None:
    """The sketch hashes keys with xxh3, not Python's per-process salted `hash()`: a
    tiny sketch, where every key collides with others, estimates alike under two hash
    seeds (so a replay gives the same verdicts in every run)."""
    code = (
        "from tierkv.policies.admission import SightingSketch;"
        "keys = [i.to_bytes(4, 'big') * 9 for i in range(300)];"
        "s = SightingSketch(width_bits=5, depth=2);"
        "[s.add(keys[j:j + 7]) for j in range(0, 300, 3)];"
        "print(s.estimate(keys).tolist())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1


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


# -- tinylfu: admission relative to the block the tier would evict ----------------------
def _keys(n: int) -> list[bytes]:
    return [os.urandom(20) for _ in range(n)]


def _seen(admission: ReuseAdmission, keys: list[bytes], times: int) -> None:
    for _ in range(times):
        admission.sighted(keys, tail=keys)  # misses: sightings, never a continuation


def test_a_tier_with_room_admits_every_block() -> None:
    admission = ReuseAdmission(width_bits=16)
    keys = _keys(5)
    _seen(admission, keys, 1)
    taken: list[bytes] = []
    rivals = iter(_keys(3))
    assert admission.admits_against(keys, 5, rivals) == [True] * 5
    assert admission.admits_against(keys, 9, iter(taken)) == [True] * 5
    # room for 2: the rest meet candidates; none left (all claimed): declined
    assert admission.admits_against(keys, 2, iter(())) == [True, True, False, False, False]


def test_a_block_seen_once_is_weighed_against_the_candidate() -> None:
    admission = ReuseAdmission(width_bits=16)
    new, cold, warm = _keys(1), _keys(1), _keys(1)
    _seen(admission, new, 1)
    _seen(admission, warm, 3)
    assert admission.admits_against(new, 0, iter(warm)) == [False]  # 1 < 3: kept out
    assert admission.admits_against(new, 0, iter(cold)) == [True]  # 1 > 0: displaces it
    _seen(admission, cold, 1)
    assert admission.admits_against(new, 0, iter(cold)) == [False]  # a tie keeps the incumbent
    # a candidate resident in the primary counts 0: its tier copy is not serving it
    assert admission.admits_against(new, 0, iter(warm), held_above=warm.__contains__) == [True]


def test_a_second_sighting_or_a_continuation_is_admitted_against_any_candidate() -> None:
    admission = ReuseAdmission(width_bits=16)
    hot = _keys(1)
    _seen(admission, hot, 9)
    twice = _keys(1)
    _seen(admission, twice, 2)
    assert admission.admits_against(twice, 0, iter(hot)) == [True]
    turn1 = _keys(6)
    admission.sighted(turn1, tail=turn1)
    turn2 = [*turn1, *_keys(2)]
    admission.sighted(turn2, tail=turn2[6:])  # hit 6 of 8: continuing
    assert admission.admits_against(turn2[6:], 0, iter(hot * 2)) == [True, True]


def test_each_admitted_block_displaces_the_next_candidate() -> None:
    admission = ReuseAdmission(width_bits=16)
    keys, rivals = _keys(3), _keys(3)
    _seen(admission, keys, 1)
    _seen(admission, rivals[1:2], 5)  # the second candidate is popular
    read: list[bytes] = []

    def candidates() -> Iterator[bytes]:
        for r in rivals:
            read.append(r)
            yield r

    # key 0 displaces rival 0 (never seen); key 1 meets rival 1 (popular) and is kept
    # out, so key 2 meets rival 1 too
    assert admission.admits_against(keys, 0, candidates()) == [True, False, False]
    assert read == rivals  # never more candidates than keys past the room
    read.clear()
    assert admission.admits_against(keys, 2, candidates()) == [True, True, True]
    assert read == rivals[:1]


def test_aging_lets_a_new_block_past_a_candidate_whose_popularity_faded() -> None:
    admission = ReuseAdmission(width_bits=16)
    admission.age_every(10)
    assert admission.sketch.reset_every == MIN_AGING_PERIOD  # never faster than this
    admission.age_every(MIN_AGING_PERIOD * 2)
    assert admission.sketch.reset_every == MIN_AGING_PERIOD * 2
    old, new = _keys(1), _keys(1)
    _seen(admission, old, 2)
    _seen(admission, new, 1)
    assert admission.admits_against(new, 0, iter(old)) == [False]
    while admission.sketch.halvings < 2:  # other traffic: 2 -> 1 -> 0
        admission.sighted(_keys(256), ())
    _seen(admission, new, 1)  # seen again since: 1 (halved to 0) + 1
    assert int(admission.sketch.estimate(old)[0]) == 0
    assert admission.admits_against(new, 0, iter(old)) == [True]


@settings(max_examples=80, deadline=None)
@given(
    seen=st.lists(st.integers(0, 4), min_size=0, max_size=12),
    rival_seen=st.lists(st.integers(0, 4), min_size=0, max_size=12),
    free=st.integers(-3, 14),
)
def test_tinylfu_verdicts_follow_the_rule(
    seen: list[int], rival_seen: list[int], free: int
) -> None:
    admission = ReuseAdmission(width_bits=16)
    keys, rivals = _keys(len(seen)), _keys(len(rival_seen))
    for key, n in [*zip(keys, seen), *zip(rivals, rival_seen)]:
        _seen(admission, [key], n)
    verdicts = admission.admits_against(keys, free, iter(rivals))
    room = max(0, min(free, len(keys)))
    assert len(verdicts) == len(keys) and all(verdicts[:room])
    # past the room, the same walk by hand: each admitted key displaces one candidate
    j = 0
    for key_seen, verdict in zip(seen[room:], verdicts[room:]):
        wins = j < len(rivals) and (key_seen >= 2 or key_seen > rival_seen[j])
        assert verdict == wins
        j += wins
    assert sum(verdicts) - room <= len(rivals)  # never more than the tier can evict
