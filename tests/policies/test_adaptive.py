"""Adaptive admission (tierkv.policies.adaptive): the duel of a write-all and a tinylfu
shadow chain picks the rule that serves more, deterministically, in bounded memory."""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tierkv.policies.adaptive import SHADOW_BLOCKS, AdaptiveAdmission, ShadowChain


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
    admission = AdaptiveAdmission(width_bits=12)
    admission.size_for(SHADOW_BLOCKS * 4, 100)  # one key in four
    assert admission.sampling == 4
    admission.sighted([bytes([63]) + bytes(19)], ())
    admission.sighted([bytes([64]) + bytes(19)], ())
    assert list(admission.all_shadow.primary) == [bytes([63]) + bytes(19)]


@pytest.mark.parametrize(
    ("tier", "rate", "shadow"),
    [(100, 1, 100), (SHADOW_BLOCKS, 1, SHADOW_BLOCKS), (10 * SHADOW_BLOCKS, 16, 2560)],
)
def test_the_shadows_are_scaled_to_at_most_shadow_blocks(tier: int, rate: int, shadow: int) -> None:
    admission = AdaptiveAdmission(width_bits=12)
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
    assert admission.max_shadow_keys == 4 * SHADOW_BLOCKS


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
        for chain in (admission.all_shadow, admission.tinylfu_shadow):
            assert len(chain.tier) <= chain.tier_blocks
            assert len(chain.primary) <= chain.primary_blocks
        free = tier - len(ks)
        verdicts = admission.admits_adaptive(ks, free, iter([key("c", i) for i in range(12)]))
        assert len(verdicts) == len(ks)
        if admission.writes_all or free >= len(ks):
            assert all(verdicts)
    total = sum(
        len(c.tier) + len(c.primary) for c in (admission.all_shadow, admission.tinylfu_shadow)
    )
    assert total <= admission.max_shadow_keys


def test_a_shadow_scores_only_the_prefix() -> None:
    chain = ShadowChain(primary_blocks=1, tier_blocks=8)
    a, b, c = key("s", 0), key("s", 1), key("s", 2)
    chain.write(chain.ask([a, b, c]))
    chain.tier.pop(b)  # b gone: c, though held, is past the hit
    assert chain.ask([a, b, c]) == [b]
    assert chain.hits == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="shadow_blocks"):
        AdaptiveAdmission(shadow_blocks=0)
    with pytest.raises(ValueError, match="margin"):
        AdaptiveAdmission(margin=1.5)
    with pytest.raises(ValueError, match="decay_per_block"):
        AdaptiveAdmission(decay_per_block=0)
