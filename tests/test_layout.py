"""The KV layout model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tierkv.layout import GroupSpec, KVLayout


def test_layout_with_hybrid_groups() -> None:
    layout = KVLayout(
        block_bytes="2MiB",  # type: ignore[arg-type]
        groups=(
            GroupSpec(block_size=16),
            GroupSpec(kind="sliding_window", block_size=32, window=1024),
        ),
    )
    assert layout.block_bytes == 2 * 2**20 and layout.num_groups == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "sliding_window", "block_size": 16}, "needs `window`"),
        ({"kind": "full", "block_size": 16, "window": 8}, "takes no `window`"),
        ({"block_size": 0}, "greater than 0"),
        ({"kind": "linear", "block_size": 16}, "'full', 'sliding_window' or 'state'"),
    ],
)
def test_bad_groups(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GroupSpec(**kwargs)  # type: ignore[arg-type]


def test_layout_needs_a_group_and_positive_bytes() -> None:
    with pytest.raises(ValidationError):
        KVLayout(block_bytes=1024, groups=())  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        KVLayout(block_bytes=0, groups=(GroupSpec(block_size=16),))  # type: ignore[arg-type]


def test_checkpoints_must_land_where_every_group_has_a_boundary() -> None:
    groups = (GroupSpec(block_size=16), GroupSpec(kind="state", block_size=24))
    layout = KVLayout(block_bytes=64, groups=groups, checkpoint_every=96)  # type: ignore[arg-type]
    assert layout.hit_step == 48 and layout.checkpoint_tokens == 96
    assert KVLayout(block_bytes=64, groups=groups).checkpoint_tokens == 48  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"100 is not a multiple .* of 48; use e\.g\. 96"):
        KVLayout(block_bytes=64, groups=groups, checkpoint_every=100)  # type: ignore[arg-type]
