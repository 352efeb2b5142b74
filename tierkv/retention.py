"""Which blocks of a store are worth keeping: the store side of the hit rule.

A hit lands on a token count `L` that every group can serve (`tierkv.hits`). A
full-attention group needs every block before `L`, so a store keeps all of its blocks
(any longer hit needs them). A sliding-window group needs only the blocks inside its
window before `L`, and a state group only the state at `L`: a block that no hit can
need is bytes written, cascaded and evicted for nothing. Long conversations are where
this matters: a sliding-window group of 4096 tokens over a 128k-token prefix needs 2 %
of its blocks for any one hit.

Where hits may land is the layout's choice (`KVLayout.checkpoint_every`, tokens):

- every multiple of `checkpoint_tokens` (`checkpoint_every`, or the layout's `hit_step`
  when unset: every point a hit can land on at all), and
- the end of the request the store holds (`end_tokens`, aligned down to `hit_step`):
  the next turn of a conversation extends exactly that prefix.

A block is kept when some checkpoint's hit needs it: a state block `j` when
`(j + 1) * block_size` is a checkpoint; a sliding-window block `j` when a checkpoint
lies in `[(j + 1) * block_size, (j + 1) * block_size + window - 2]` (the tokens whose
window still reaches into the block). Checkpoints past what the store holds count too
(a later store of the same request completes them). A lookup then lands hits on
checkpoints by itself: the skipped blocks are simply absent.

With `checkpoint_every` unset and one block size for every group, nothing is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.contract.keys import OffloadKey, get_offload_group_idx
from tierkv.layout import GroupSpec, KVLayout


def _has_multiple(lo: int, hi: int, every: int) -> bool:
    """Whether a positive multiple of `every` lies in `[lo, hi]`."""
    first = max(every, -(-lo // every) * every)
    return first <= hi


def block_kept(group: GroupSpec, block: int, every: int, end: int) -> bool:
    """Whether block `block` of `group` serves a hit at some checkpoint: a multiple of
    `every` tokens, or `end` (0: no end checkpoint)."""
    if group.kind == "full":
        return True
    bs = group.block_size
    lo = (block + 1) * bs  # the first hit that needs the block: the one ending it
    if group.kind == "state":
        return lo % every == 0 or lo == end
    assert group.window is not None
    hi = lo + group.window - 2  # the last hit whose window reaches into the block
    if hi < lo:  # a window of one token needs no block before the hit
        return False
    return _has_multiple(lo, hi, every) or lo <= end <= hi


def end_checkpoint(layout: KVLayout, keys: Sequence[OffloadKey], positions: Sequence[int]) -> int:
    """The end of what a store holds, as a hit point: the smallest end of any group the
    store has blocks of (a hit needs every group), aligned down to `hit_step`."""
    ends: dict[int, int] = {}
    for key, j in zip(keys, positions):
        g = get_offload_group_idx(key)
        ends[g] = max(ends.get(g, 0), (j + 1) * layout.groups[g].block_size)
    if not ends:
        return 0
    step = layout.hit_step
    return min(ends.values()) // step * step


def kept_blocks(
    layout: KVLayout,
    keys: Sequence[OffloadKey],
    positions: Sequence[int],
    end_tokens: int | None = None,
) -> list[bool]:
    """For each key (block `positions[i]` of the group its key names), whether a store
    keeps it. `end_tokens`: the request's length this store completes (a hit may land
    there); None: the end of what `keys` hold; 0: no end checkpoint (a store in the
    middle of a request). Raises ValueError for positions that do not match the keys
    or a key of a group the layout lacks."""
    if len(positions) != len(keys):
        raise ValueError(f"{len(positions)} positions for {len(keys)} keys; give one per key")
    for i, j in enumerate(positions):
        if isinstance(j, bool) or not isinstance(j, int) or j < 0:
            raise ValueError(f"positions[{i}] must be a block index (int >= 0), got {j!r}")
    if end_tokens is not None and (
        isinstance(end_tokens, bool) or not isinstance(end_tokens, int) or end_tokens < 0
    ):
        raise ValueError(f"end_tokens must be a token count (int >= 0), got {end_tokens!r}")
    groups = layout.groups
    for i, key in enumerate(keys):
        if get_offload_group_idx(key) >= len(groups):
            raise ValueError(
                f"keys[{i}] names group {get_offload_group_idx(key)}; the layout has "
                f"{len(groups)} group(s)"
            )
    if all(g.kind == "full" for g in groups):
        return [True] * len(keys)
    step = layout.hit_step
    end = (
        end_checkpoint(layout, keys, positions) if end_tokens is None else end_tokens // step * step
    )
    every = layout.checkpoint_tokens
    return [
        block_kept(groups[get_offload_group_idx(k)], j, every, end) for k, j in zip(keys, positions)
    ]
