"""Adaptive admission (tierkv.policies.adaptive): the duel of a write-all and a tinylfu
shadow chain picks the rule that serves more, deterministically, in bounded memory."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tierkv.policies.adaptive import (
    MIN_SAMPLING,
    MIN_SHADOW_BLOCKS,
    SHADOW_BLOCKS,
    AdaptiveAdmission,
)
from tierkv.policies.admission import ReuseAdmission, SightingSketch


def key(tag: str, n: int) -> bytes:
    """A 20-byte key as uniform as a real block hash (its first byte picks the sample)."""
    return hashlib.sha256(f"{tag}/{n}".encode()).digest()[:16] + bytes(4)


def one_shot_heavy(admission: AdaptiveAdmission, rounds: int) -> None:
    """A popular set asked every round among a stream of one-shot blocks: an LRU of the
    tier's size (write-all) loses the popular set to the stream; tinylfu keeps it."""
    serial = 0
    for _ in range(rounds):
        for n in range(48):
            k = key("popular", n)
            admission.sighted([k], [k])
        for _ in range(100):
            k = key("once", serial)
            serial += 1
            admission.sighted([k], [k])


def second_turns(admission: AdaptiveAdmission, blocks: int) -> None:
    """A tier full of blocks popular long ago, then every new block asked twice, ten
    requests apart: tinylfu keeps the old blocks and declines each new one, whose second
    ask then misses; write-all serves every second ask."""
    for _ in range(5):
        for n in range(64):
            k = key("old", n)
            admission.sighted([k], [k])
    for n in range(blocks + 10):
        if n < blocks:
            k = key("turn", n)
            admission.sighted([k], [k])
        if n >= 10:
            k = key("turn", n - 10)
            admission.sighted([k], [k])


def small(**kwargs: int | float) -> AdaptiveAdmission:
    admission = AdaptiveAdmission(width_bits=12, **kwargs)  # type: ignore[arg-type]
    admission.size_for(64, 1)  # every key sampled
    return admission


def test_a_stream_of_one_shot_blocks_chooses_tinylfu() -> None:
    admission = small()
    one_shot_heavy(admission, rounds=6)
    assert admission.tinylfu_shadow.hits > admission.all_shadow.hits
    assert not admission.writes_all
    # a new block against a popular candidate is declined, as tinylfu does
    popular = key("popular", 0)
    assert admission.admits_adaptive([key("new", 0)], 0, iter([popular])) == [False]


def test_second_turns_choose_write_all() -> None:
    admission = small()
    second_turns(admission, blocks=400)
    assert admission.all_shadow.hits > admission.tinylfu_shadow.hits
    assert admission.writes_all
    old = key("old", 0)
    assert admission.admits_adaptive([key("new", 0), key("new", 1)], 0, iter([old])) == [
        True,
        True,
    ]
    assert admission.admits_adaptive_blind([key("new", 2)]) == [True]


def test_the_choice_follows_a_workload_that_changes() -> None:
    admission = small()
    second_turns(admission, blocks=400)
    assert admission.writes_all
    one_shot_heavy(admission, rounds=30)  # the old scores decay away
    assert not admission.writes_all
    assert admission.switches >= 2


def test_nothing_seen_yet_is_tinylfu() -> None:
    admission = small()
    assert not admission.writes_all
    assert admission.admits_adaptive([key("a", 0)], 1, iter(())) == [True]  # free room
    assert admission.admits_adaptive_blind([key("a", 1)]) == [False]  # reuse: seen 0 times


def test_decisions_are_deterministic() -> None:
    runs = []
    for _ in range(2):
        admission = small()
        second_turns(admission, blocks=120)
        one_shot_heavy(admission, rounds=3)
        verdicts = admission.admits_adaptive(
            [key("x", n) for n in range(8)], 2, iter([key("old", n) for n in range(6)])
        )
        runs.append(
            (
                verdicts,
                admission.writes_all,
                admission.switches,
                admission.all_shadow.hits,
                admission.tinylfu_shadow.hits,
                list(admission.tinylfu_shadow.tier),
            )
        )
    assert runs[0] == runs[1]


def test_a_key_is_sampled_by_its_first_byte() -> None:
    admission = AdaptiveAdmission(width_bits=12, min_sampling=1)
    admission.size_for(SHADOW_BLOCKS * 4, 100)  # one key in four
    assert admission.sampling == 4
    admission.sighted([bytes([63]) + bytes(19)], ())
    admission.sighted([bytes([64]) + bytes(19)], ())
    assert list(admission.all_shadow.primary) == [bytes([63]) + bytes(19)]


@pytest.mark.parametrize(
    ("tier", "rate", "shadow"),
    [
        (100, 1, 100),
        (2 * MIN_SHADOW_BLOCKS - 1, 1, 2 * MIN_SHADOW_BLOCKS - 1),  # too small to sample
        (2 * MIN_SHADOW_BLOCKS, 2, MIN_SHADOW_BLOCKS),
        (SHADOW_BLOCKS, 8, SHADOW_BLOCKS // 8),  # the floor
        (10 * SHADOW_BLOCKS, 16, 2560),
    ],
)
def test_the_shadows_are_scaled_to_at_most_shadow_blocks(tier: int, rate: int, shadow: int) -> None:
    admission = AdaptiveAdmission(width_bits=12, min_sampling=8)
    admission.size_for(tier, tier // 10)
    assert admission.sampling == rate
    assert admission.all_shadow.tier_blocks == shadow
    assert admission.all_shadow.tier_blocks <= SHADOW_BLOCKS


def test_a_huge_tier_samples_at_most_one_key_in_256() -> None:
    admission = AdaptiveAdmission(width_bits=12)
    admission.size_for(1 << 40, 1 << 30)
    assert admission.sampling == 256 and admission._sampled_below == 1
    # still bounded: each shadow structure holds at most SHADOW_BLOCKS keys
    assert admission.all_shadow.tier_blocks == SHADOW_BLOCKS
    assert admission.all_shadow.primary_blocks == SHADOW_BLOCKS
    assert admission.max_shadow_keys == 3 * SHADOW_BLOCKS  # two tiers, one shared primary


def test_a_primary_larger_than_the_tier_is_capped_in_the_shadows() -> None:
    admission = AdaptiveAdmission(width_bits=12)
    admission.size_for(100, 1 << 20)
    assert admission.sampling == 1
    assert admission.all_shadow.primary_blocks == SHADOW_BLOCKS


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=12, unique=True), max_size=80),
    st.integers(1, 40),
    st.integers(0, 8),
)
def test_memory_stays_bounded_and_verdicts_are_whole(
    requests: list[list[int]], tier: int, primary: int
) -> None:
    admission = AdaptiveAdmission(width_bits=10)
    admission.size_for(tier, primary)
    for ids in requests:
        ks = [key("p", i) for i in ids]
        admission.sighted(ks, ks[len(ks) // 2 :])
        assert admission.all_shadow.primary is admission.tinylfu_shadow.primary  # shared
        for chain in (admission.all_shadow, admission.tinylfu_shadow):
            assert len(chain.tier) <= chain.tier_blocks
            assert len(chain.primary) <= chain.primary_blocks
        free = tier - len(ks)
        verdicts = admission.admits_adaptive(ks, free, iter([key("c", i) for i in range(12)]))
        assert len(verdicts) == len(ks)
        if admission.writes_all or free >= len(ks):
            assert all(verdicts)
    shadows = admission.all_shadow, admission.tinylfu_shadow
    total = len(shadows[0].primary) + sum(len(c.tier) for c in shadows)
    assert total <= admission.max_shadow_keys


def test_a_shadow_scores_only_the_prefix() -> None:
    admission = AdaptiveAdmission(width_bits=12, min_sampling=1)
    admission.size_for(8, 1)
    chain = admission.all_shadow
    a, b, c = key("s", 0), key("s", 1), key("s", 2)
    admission.sighted([a, b, c])
    assert list(chain.tier) == [a, b, c] and chain.hits == 0
    chain.tier.pop(b)  # b gone: c, though held, is past the hit
    admission.sighted([a, b, c])
    assert chain.hits == 1  # a (in the primary or the tier); not c
    assert list(chain.tier) == [c, a, b]  # a read from the tier; b written again


class ReferenceChain:
    """The shadow chain as first written (one chain at a time, a dict operation per
    step): the one-pass duel must leave what it leaves."""

    def __init__(self, primary_blocks: int, tier_blocks: int) -> None:
        self.primary: OrderedDict[bytes, None] = OrderedDict()
        self.tier: OrderedDict[bytes, None] = OrderedDict()
        self.primary_blocks, self.tier_blocks = max(1, primary_blocks), max(1, tier_blocks)
        self.hits = 0.0

    def ask(self, keys: list[bytes]) -> list[bytes]:
        prefix, new = True, []
        for k in keys:
            in_primary, in_tier = k in self.primary, k in self.tier
            if prefix and (in_primary or in_tier):
                self.hits += 1
                if in_tier and not in_primary:
                    self.tier.move_to_end(k)
            else:
                prefix = False
                if not in_tier:
                    new.append(k)
            self.primary[k] = None
            self.primary.move_to_end(k)
            if len(self.primary) > self.primary_blocks:
                self.primary.popitem(last=False)
        return new

    def write(self, keys: list[bytes]) -> None:
        for k in keys:
            self.tier[k] = None
            if len(self.tier) > self.tier_blocks:
                self.tier.popitem(last=False)

    def write_against(self, keys: list[bytes], admitted: Callable[..., list[bool]]) -> None:
        free = self.tier_blocks - len(self.tier)
        rivals = list(islice(iter(self.tier), max(0, len(keys) - free)))
        displaced = iter(rivals)
        for k, ok in zip(keys, admitted(keys, free, iter(rivals))):
            if ok:
                if len(self.tier) >= self.tier_blocks:
                    del self.tier[next(displaced)]
                self.tier[k] = None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True), max_size=120),
    st.integers(1, 60),
    st.integers(0, 12),
)
def test_the_one_pass_duel_leaves_what_two_chains_asked_in_turn_leave(
    requests: list[list[int]], tier: int, primary: int
) -> None:
    admission = AdaptiveAdmission(width_bits=6, min_sampling=1, decay_per_block=1)
    admission.size_for(tier, primary)
    admission.age_every(1)  # halvings too
    admission.sketch.reset_every = 97
    reference = ReuseAdmission(width_bits=6)
    reference.sketch.reset_every = 97
    everything, selective = ReferenceChain(primary, tier), ReferenceChain(primary, tier)
    for n, ids in enumerate(requests):
        ks = [key("d", i) for i in ids]
        tail = ks[len(ks) // 2 :] if n % 3 else ks
        admission.sighted(ks, tail)
        reference.sighted(ks, tail)
        everything.write(everything.ask(ks))
        selective.write_against(selective.ask(ks), reference.admits_against)
        for chain, model in (
            (admission.all_shadow, everything),
            (admission.tinylfu_shadow, selective),
        ):
            assert list(chain.tier) == list(model.tier)
            assert list(chain.primary) == list(model.primary)
    assert admission.sketch.halvings == reference.sketch.halvings


@pytest.mark.parametrize("floor", sorted({1, 8, MIN_SAMPLING}))
@pytest.mark.parametrize("tier", [64, 2 * MIN_SHADOW_BLOCKS, 5000, SHADOW_BLOCKS * 300])
def test_the_sampling_floor_bounds_the_shadows_and_keeps_decisions_deterministic(
    tier: int, floor: int
) -> None:
    runs = []
    for _ in range(2):
        admission = AdaptiveAdmission(width_bits=12, min_sampling=floor)
        admission.size_for(tier, tier // 20)
        rate, shadow = admission.sampling, admission.all_shadow.tier_blocks
        assert rate >= floor or tier // (2 * rate) < MIN_SHADOW_BLOCKS
        assert shadow >= min(tier, MIN_SHADOW_BLOCKS) and shadow <= SHADOW_BLOCKS
        assert admission.max_shadow_keys <= 3 * SHADOW_BLOCKS
        second_turns(admission, blocks=300)
        one_shot_heavy(admission, rounds=3)
        for chain in (admission.all_shadow, admission.tinylfu_shadow):
            assert len(chain.tier) <= chain.tier_blocks
            assert len(chain.primary) <= chain.primary_blocks
        runs.append(
            (
                admission.writes_all,
                admission.switches,
                admission.all_shadow.hits,
                list(admission.tinylfu_shadow.tier),
                list(admission.all_shadow.primary),
            )
        )
    assert runs[0] == runs[1]


def test_add_then_estimate_is_add_then_estimate() -> None:
    one, two = SightingSketch(8), SightingSketch(8)
    one.reset_every = two.reset_every = 50
    for n in range(60):
        ks = [key("a", (n * 7 + i) % 90) for i in range(9)]
        others = [key("a", (n + i) % 90) for i in range(n % 4)]
        counts, theirs = one.add_then_estimate(ks, others)
        assert counts.tolist() == two.add(ks).tolist()
        assert theirs.tolist() == two.estimate(others).tolist()
    assert one.halvings == two.halvings > 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="shadow_blocks"):
        AdaptiveAdmission(shadow_blocks=0)
    with pytest.raises(ValueError, match="margin"):
        AdaptiveAdmission(margin=1.5)
    with pytest.raises(ValueError, match="decay_per_block"):
        AdaptiveAdmission(decay_per_block=0)
    with pytest.raises(ValueError, match="min_sampling"):
        AdaptiveAdmission(min_sampling=3)
