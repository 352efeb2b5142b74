"""The shape of the KV data tierkv keeps: block bytes and KV-cache groups.

Every block in every group has the same byte size (`block_bytes`, the primary slab's
row). Groups differ in attention kind and block size in tokens: a full-attention group
needs every block of a prefix, a sliding-window group only those inside its window,
and a state group (Mamba / linear-attention layers that carry a recurrent state) only
one block: block `j` of a state group holds the state after tokens
`[0, (j + 1) * block_size)`, so serving `L` tokens needs block `L // block_size - 1`
and nothing before it (`tierkv.hits`).

A hit is always a multiple of every group's block size (`KVLayout.hit_step`).
`checkpoint_every` (tokens, a multiple of `hit_step`) says where hits of stored
requests may land: stores then keep only the blocks a hit at such a checkpoint (or at
the end of what a store holds) can use (`tierkv.retention`); unset, every `hit_step`
boundary is a checkpoint.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tierkv.contract.units import Size


class GroupSpec(BaseModel):
    """One KV-cache group: layers sharing an attention kind and a block table.

    `kind`: `full` (every block of a prefix), `sliding_window` (the blocks inside
    `window` tokens), or `state` (one block per block boundary: the recurrent state
    after that many tokens; a hit needs only the state at its own length)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["full", "sliding_window", "state"] = "full"
    block_size: PositiveInt = Field(description="tokens per offloaded block")
    window: PositiveInt | None = Field(
        default=None, description="sliding window in tokens (sliding_window groups only)"
    )

    @model_validator(mode="after")
    def _window_matches_kind(self) -> GroupSpec:
        if self.kind == "sliding_window" and self.window is None:
            raise ValueError("a sliding_window group needs `window` (tokens)")
        if self.kind != "sliding_window" and self.window is not None:
            raise ValueError(f"a {self.kind} group takes no `window`; use kind: sliding_window")
        return self


class KVLayout(BaseModel):
    """Block bytes plus one or more groups; the index in `groups` is the group index
    encoded in every `OffloadKey`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_bytes: Size = Field(gt=0)
    groups: tuple[GroupSpec, ...] = Field(min_length=1)
    checkpoint_every: PositiveInt | None = Field(
        default=None,
        description="tokens between the hit points stores keep sliding-window and state "
        "blocks for (a multiple of every group's block_size); unset: every block boundary",
    )

    @field_validator("checkpoint_every")
    @classmethod
    def _checkpoints_fit_every_group(cls, every: int | None, info: ValidationInfo) -> int | None:
        groups = info.data.get("groups")
        if every is None or not groups:  # groups failed on their own: said there
            return every
        sizes = sorted({g.block_size for g in groups})
        step = math.lcm(*sizes)
        if every % step:
            raise ValueError(
                f"{every} is not a multiple of every group's block_size "
                f"({', '.join(map(str, sizes))}): a hit can only land on a multiple of "
                f"{step}; use e.g. {max(step, every // step * step)}"
            )
        return every

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hit_step(self) -> int:
        """The least common multiple of the groups' block sizes: every hit (each group
        serving whole blocks of its own) is a multiple of it."""
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def checkpoint_tokens(self) -> int:
        """Tokens between checkpoints: `checkpoint_every`, or `hit_step` when unset."""
        return self.checkpoint_every or self.hit_step
