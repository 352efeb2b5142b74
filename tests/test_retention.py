"""Which blocks a store keeps (`tierkv.retention`), against a brute-force definition:
a block is kept exactly when a hit at some checkpoint needs it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.layout import GroupSpec, KVLayout
from tierkv.retention import kept_blocks
from tierkv.testing.hits_oracle import blocks_needed


def key(g: int, j: int) -> OffloadKey:
    return make_offload_key(j.to_bytes(8, "big"), g)


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["full", "sliding_window", "state"]))
        bs = draw(st.sampled_from([1, 2, 4, 8]))
        window = draw(st.integers(1, 40)) if kind == "sliding_window" else None
        groups.append(GroupSpec(kind=kind, block_size=bs, window=window))
    layout = KVLayout(block_bytes=64, groups=tuple(groups))
    every = draw(st.one_of(st.none(), st.integers(1, 6).map(lambda m: m * layout.hit_step)))
    return KVLayout(block_bytes=64, groups=tuple(groups), checkpoint_every=every)


@settings(max_examples=300, deadline=None)
@given(layout=layouts(), tokens=st.integers(0, 96), end=st.one_of(st.none(), st.integers(0, 96)))
def test_a_block_is_kept_exactly_when_a_checkpoint_hit_needs_it(
    layout: KVLayout, tokens: int, end: int | None
) -> None:
    keys: list[OffloadKey] = []
    positions: list[int] = []
    for g, group in enumerate(layout.groups):
        for j in range(tokens // group.block_size):
            keys.append(key(g, j))
            positions.append(j)
    kept = kept_blocks(layout, keys, positions, end)
    step, every = layout.hit_step, layout.checkpoint_tokens
    if end is None:  # the end of what the store holds: every group's last block
        ends = [tokens // g.block_size * g.block_size for g in layout.groups]
        end_point = min(ends) // step * step
    else:
        end_point = end // step * step
    horizon = tokens + max((g.window or 0) for g in layout.groups) + every
    checkpoints = {p for p in range(every, horizon + 1, every)} | {end_point}
    for g, group in enumerate(layout.groups):
        want = set().union(*(blocks_needed(group, p) for p in checkpoints))
        got = {j for k, j, ok in zip(keys, positions, kept) if ok and k[-1] == g}
        have = set(range(tokens // group.block_size))
        if group.kind == "full":
            assert got == have
        else:
            assert got == want & have, (group, sorted(got), sorted(want & have))


def test_with_one_block_size_and_no_checkpoint_setting_nothing_is_skipped() -> None:
    layout = KVLayout(
        block_bytes=64,
        groups=(
            GroupSpec(block_size=16),
            GroupSpec(kind="sliding_window", block_size=16, window=40),
            GroupSpec(kind="state", block_size=16),
        ),
    )
    keys = [key(g, j) for g in range(3) for j in range(10)]
    assert all(kept_blocks(layout, keys, [j for _ in range(3) for j in range(10)]))


def test_a_store_in_the_middle_of_a_request_keeps_only_regular_checkpoints() -> None:
    layout = KVLayout(
        block_bytes=64,
        groups=(GroupSpec(kind="state", block_size=16),),
        checkpoint_every=64,
    )
    keys = [key(0, j) for j in range(6)]  # states after 16, 32, ..., 96 tokens
    assert kept_blocks(layout, keys, list(range(6))) == [
        False, False, False, True, False, True,  # 64, and 96: the end of the store
    ]  # fmt: skip
    assert kept_blocks(layout, keys, list(range(6)), end_tokens=0) == [
        False, False, False, True, False, False,
    ]  # fmt: skip
    assert kept_blocks(layout, keys, list(range(6)), end_tokens=80) == [
        False, False, False, True, True, False,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("positions", "end", "message"),
    [
        ([0], None, "1 positions for 2 keys"),
        ([0, -1], None, r"positions\[1\] must be a block index"),
        ([0, True], None, r"positions\[1\] must be a block index"),
        ([0, 1], -5, "end_tokens must be a token count"),
    ],
)
def test_bad_positions_are_refused(positions: list[int], end: int | None, message: str) -> None:
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(kind="state", block_size=16),))
    with pytest.raises(ValueError, match=message):
        kept_blocks(layout, [key(0, 0), key(0, 1)], positions, end)


def test_a_key_of_a_group_the_layout_lacks_is_refused() -> None:
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(block_size=16),))
    with pytest.raises(ValueError, match=r"keys\[0\] names group 3; the layout has 1"):
        kept_blocks(layout, [key(3, 0)], [0])
