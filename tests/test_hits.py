"""Combining the hits of several KV-cache groups."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv.hits import GroupHit, combine_group_hits
from tierkv.layout import GroupSpec

FULL16 = GroupSpec(block_size=16)
FULL32 = GroupSpec(block_size=32)


def sliding(block_size: int, window: int) -> GroupSpec:
    return GroupSpec(kind="sliding_window", block_size=block_size, window=window)


def test_full_group_stops_at_the_first_missing_block() -> None:
    assert combine_group_hits([FULL16], [[True, True, False, True]]) == (32, [GroupHit(0, 2)])
    assert combine_group_hits([FULL16], [[False, True]]) == (0, [GroupHit(0, 0)])
    assert combine_group_hits([FULL16], [[]]) == (0, [GroupHit(0, 0)])


def test_groups_with_different_block_sizes_align_to_each() -> None:
    # 16-token group has 5 blocks (80 tokens); 32-token group has 2 full blocks (64)
    tokens, ranges = combine_group_hits([FULL16, FULL32], [[True] * 5, [True, True]])
    assert tokens == 64 and ranges == [GroupHit(0, 4), GroupHit(0, 2)]
    # the 32-token group's second block missing caps everyone at 32
    tokens, _ = combine_group_hits([FULL16, FULL32], [[True] * 5, [True, False]])
    assert tokens == 32


def test_sliding_window_needs_only_blocks_inside_the_window() -> None:
    window = sliding(16, 32)  # the next token needs the 31 tokens before it: 2 blocks
    present = [False, False, False, True, True]
    tokens, ranges = combine_group_hits([window], [present])
    assert tokens == 80 and ranges == [GroupHit(3, 5)]


def test_full_plus_window_where_the_window_group_limits_the_hit() -> None:
    full = [True] * 6
    window = [True, True, True, False, True, True]  # block 3 missing
    tokens, ranges = combine_group_hits([FULL16, sliding(16, 32)], [full, window])
    # 96 needs window blocks 4,5 (ok)... the hit is 96
    assert tokens == 96 and ranges[1] == GroupHit(4, 6)
    window = [True, True, True, True, False, True]  # block 4 missing: 96 needs it
    tokens, ranges = combine_group_hits([FULL16, sliding(16, 32)], [full, window])
    assert tokens == 64  # 64 needs window blocks 2,3
    assert ranges == [GroupHit(0, 4), GroupHit(2, 4)]


def test_full_group_limits_and_window_follows() -> None:
    full = [True, True, False, True, True, True]
    window = [True] * 6
    tokens, ranges = combine_group_hits([FULL16, sliding(16, 64)], [full, window])
    assert tokens == 32 and ranges == [GroupHit(0, 2), GroupHit(0, 2)]


def test_group_count_must_match() -> None:
    with pytest.raises(ValueError, match="1 groups of keys for a layout of 2 groups"):
        combine_group_hits([FULL16, FULL16], [[True]])


@given(
    st.lists(st.booleans(), max_size=12),
    st.lists(st.booleans(), max_size=12),
    st.sampled_from([8, 16]),
    st.integers(1, 64),
)
def test_hit_is_the_largest_servable_prefix(
    full: list[bool], window: list[bool], bs: int, w: int
) -> None:
    """Brute force: the hit is the largest token count every group can serve."""
    groups = [GroupSpec(block_size=16), sliding(bs, w)]
    tokens, _ = combine_group_hits(groups, [full, window])

    def serves(t: int) -> bool:
        if t % 16 or t % bs or t // 16 > len(full) or t // bs > len(window):
            return False
        if not all(full[: t // 16]):
            return False
        first = max(0, t - (w - 1)) // bs
        return all(window[first : t // bs])

    best = max(t for t in range(0, 16 * 13, 1) if t == 0 or serves(t))
    assert tokens == best


def _brute_group_limit(group: GroupSpec, present: list[bool], limit: int) -> int:
    """The definition, candidate by candidate (O(blocks x window))."""
    bs = group.block_size
    for n in range(min(limit // bs, len(present)), 0, -1):
        tokens = n * bs
        if group.kind == "full" or group.window is None:
            first = 0
        else:
            first = max(0, tokens - (group.window - 1)) // bs
        if all(present[first:n]):
            return tokens
    return 0


@given(
    present=st.lists(st.booleans(), max_size=40),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.integers(1, 80),
    limit=st.integers(0, 700),
)
def test_one_pass_sliding_window_limit_matches_the_definition(
    present: list[bool], block_size: int, window: int, limit: int
) -> None:
    from tierkv.hits import _group_limit

    group = sliding(block_size, window)
    assert _group_limit(group, present, limit) == _brute_group_limit(group, present, limit)


def test_sliding_window_hit_over_a_long_prompt_is_linear() -> None:
    # 8,192 blocks, window 32,768 tokens: the old narrowing re-scanned the window per
    # candidate; one pass answers at once (counted, not timed: one missing block)
    group = sliding(16, 32768)
    present = [True] * 8192
    present[7000] = False
    tokens, ranges = combine_group_hits([group], [present])
    assert tokens == 7000 * 16 and ranges == [GroupHit(4952, 7000)]


def state(block_size: int) -> GroupSpec:
    return GroupSpec(kind="state", block_size=block_size)


def test_state_group_needs_only_the_state_at_the_hit() -> None:
    """Block j of a state group is the state after (j + 1) blocks: a hit of 3 blocks
    needs block 2 only, whatever is missing before it."""
    tokens, ranges = combine_group_hits([state(16)], [[False, False, True, False]])
    assert tokens == 48
    assert ranges == [GroupHit(2, 3)]
    assert combine_group_hits([state(16)], [[False, False]]) == (0, [GroupHit(0, 0)])


def test_full_plus_state_backs_off_to_a_boundary_both_serve() -> None:
    """Full attention has blocks 0-3; the state exists after blocks 2 and 1 only: the
    hit is 3 blocks (the state after block 2), not 4."""
    tokens, ranges = combine_group_hits(
        [FULL16, state(16)], [[True] * 4, [False, True, True, False]]
    )
    assert tokens == 48
    assert ranges == [GroupHit(0, 3), GroupHit(2, 3)]


def test_a_state_group_takes_no_window() -> None:
    with pytest.raises(ValueError, match="a state group takes no `window`"):
        GroupSpec(kind="state", block_size=16, window=64)


def _serves(group: GroupSpec, present: list[bool], tokens: int) -> bool:
    """The definition of serving `tokens` with one group, block by block."""
    bs = group.block_size
    if tokens % bs or tokens // bs > len(present):
        return False
    n = tokens // bs
    if n == 0:
        return True
    if group.kind == "state":
        return present[n - 1]
    first = 0 if group.kind == "full" else max(0, tokens - (group.window or 1) + 1) // bs
    return all(present[first:n])


GROUPS = st.one_of(
    st.builds(GroupSpec, block_size=st.sampled_from([4, 8, 16])),
    st.builds(state, st.sampled_from([4, 8, 16])),
    st.builds(sliding, st.sampled_from([4, 8, 16]), st.integers(1, 48)),
)


@given(st.lists(st.tuples(GROUPS, st.lists(st.booleans(), max_size=12)), min_size=1, max_size=4))
def test_any_mix_of_kinds_gets_the_largest_length_every_group_serves(
    mix: list[tuple[GroupSpec, list[bool]]],
) -> None:
    groups = [g for g, _ in mix]
    present = [p for _, p in mix]
    tokens, ranges = combine_group_hits(groups, present)
    best = max(t for t in range(0, 16 * 13) if all(_serves(g, p, t) for g, p in mix))
    assert tokens == best
    for group, flags, hit in zip(groups, present, ranges):
        assert hit.end == tokens // group.block_size
        assert all(flags[hit.first : hit.end])  # every block the hit needs is present
