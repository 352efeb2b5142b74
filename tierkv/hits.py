"""How many tokens a set of KV-cache groups can serve from cached blocks.

Each group sees the request as a list of its own blocks (`block_size` tokens each)
and knows which are present somewhere in the cache. A full-attention group can serve
`L` tokens only if every block before `L` is present. A sliding-window group with
window `W` only needs the blocks holding the last `W - 1` tokens before `L` (the next
token attends to itself and the `W - 1` before it). A state group (a recurrent state
per block boundary, `tierkv.layout`) only needs the block ending at `L`. The combined
hit is the largest `L` every group can serve, each group aligned down to its own block
size: the candidate only shrinks, so narrowing group by group until nothing changes
finds it.

Each group's narrowing is one pass over its blocks: a full-attention group stops at
its first missing block; a state group at the last present block at or below the
candidate; a sliding-window group tracks, for every block, how many
present blocks end there in a row, and walks the candidates down once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.layout import GroupSpec


@dataclass(frozen=True)
class GroupHit:
    """Blocks `[first, end)` of a group are what serving the hit needs."""

    first: int
    end: int


def _needed_range(group: GroupSpec, tokens: int) -> tuple[int, int]:
    end = tokens // group.block_size
    if group.kind == "state":
        return max(0, end - 1), end
    if group.kind == "full" or group.window is None:
        return 0, end
    start_token = max(0, tokens - (group.window - 1))
    return start_token // group.block_size, end


def _group_limit(group: GroupSpec, present: Sequence[bool], limit: int) -> int:
    """The largest token count <= `limit`, aligned to the group's block size, that the
    group can serve with blocks `present`."""
    bs = group.block_size
    n = min(limit // bs, len(present))
    if group.kind == "state":
        while n > 0 and not present[n - 1]:
            n -= 1
        return n * bs
    if group.kind == "full" or group.window is None:
        for i in range(n):
            if not present[i]:
                return i * bs
        return n * bs
    # run[j]: present blocks in a row ending at block j (0 when j is missing)
    run = [0] * n
    count = 0
    for j in range(n):
        count = count + 1 if present[j] else 0
        run[j] = count
    span = group.window - 1
    while n > 0:
        first = max(0, n * bs - span) // bs
        if n - first <= 0 or run[n - 1] >= n - first:
            return n * bs
        n -= 1 + run[n - 1]  # every candidate above the last missing block needs it
    return 0


def combine_group_hits(
    groups: Sequence[GroupSpec], present: Sequence[Sequence[bool]]
) -> tuple[int, list[GroupHit]]:
    """The combined hit in tokens and, per group, the block range it needs."""
    if len(groups) != len(present):
        raise ValueError(f"{len(present)} groups of keys for a layout of {len(groups)} groups")
    if not groups:
        return 0, []
    tokens = min(len(p) * g.block_size for g, p in zip(groups, present))
    while True:
        narrowed = tokens
        for group, flags in zip(groups, present):
            narrowed = _group_limit(group, flags, narrowed)
        if narrowed == tokens:
            break
        tokens = narrowed
    ranges = [GroupHit(*_needed_range(g, tokens)) for g in groups]
    return tokens, ranges
