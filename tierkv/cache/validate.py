"""Checks a request passes before the cache changes anything for it.

Keys must be offload keys; a source or destination must hold one block per key of
the right size; an adapter over GPU blocks (`KVCacheBlocks`) checks its block ids and
coverage through its optional `validate(direction)` hook. All of this runs before a
slot is reserved, a block evicted or a promotion started, so bad input changes
nothing (no eviction, no event).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from tierkv.blocks import BlockDestination, BlockSource, as_destination, as_source
from tierkv.contract.keys import OffloadKey
from tierkv.primary import HostSlab


def check_keys(keys: Sequence[OffloadKey], what: str) -> None:
    """Every key bytes and longer than its 4 group bytes (ValueError naming the first
    that is not). The common case is two C-level passes over the keys."""
    if not keys or (set(map(type, keys)) == {bytes} and min(map(len, keys)) > 4):
        return
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise ValueError(f"{what}[{i}] must be bytes (an OffloadKey), got {type(key).__name__}")
        if len(key) <= 4:
            raise ValueError(
                f"{what}[{i}] is {len(key)} bytes; an offload key is a block hash plus 4 "
                "group bytes (use make_offload_key)"
            )


def run_validate_hook(
    adapter: object,
    direction: Literal["store", "load"],
    indices: Sequence[int] | None = None,
    view: HostSlab | None = None,
) -> None:
    """Call the adapter's `validate(direction, indices)` if it has one (`KVCacheBlocks`
    checks its GPU block ids and coverage there), and its `check_view(view)` if it has
    one (`KVCacheBlocks`: its worker copies into this cache's slab, not another's)."""
    check_view = getattr(adapter, "check_view", None)
    if view is not None and callable(check_view):
        check_view(view)
    hook = getattr(adapter, "validate", None)
    if callable(hook):
        hook(direction, indices)


def checked_source(obj: object, count: int, block_bytes: int) -> BlockSource:
    """`obj` as a source of `count` blocks, its sizes checked (ValueError otherwise).
    The caller runs `run_validate_hook` once it knows which blocks it will copy."""
    return as_source(obj, count, block_bytes)


def checked_destination(
    obj: object, count: int, block_bytes: int, view: HostSlab | None = None
) -> BlockDestination:
    """`obj` as a destination of `count` blocks, fully checked (ValueError otherwise)."""
    dest = as_destination(obj, count, block_bytes)
    run_validate_hook(dest, "load", None, view)
    return dest
