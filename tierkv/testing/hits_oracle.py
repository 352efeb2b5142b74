"""The hit rule by its definition, block by block, for tests that check the fast
one-pass rule (`tierkv.hits`) and the store side (`tierkv.retention`) against it."""

from __future__ import annotations

from typing import Any


def blocks_needed(group: Any, tokens: int) -> set[int]:
    """The blocks of `group` a hit of `tokens` needs: every block before it (full), the
    blocks holding the `window - 1` tokens before it (sliding_window), or the state
    ending at it (state). `group` is a `tierkv.layout.GroupSpec` (not imported: the
    test kit imports only the tier contract)."""
    bs = group.block_size
    if tokens == 0:
        return set()
    if group.kind == "full":
        return set(range(tokens // bs))
    if group.kind == "state":
        return {tokens // bs - 1}
    assert group.window is not None
    first_token = max(0, tokens - (group.window - 1))  # the window of the next token
    return {t // bs for t in range(first_token, tokens)}
