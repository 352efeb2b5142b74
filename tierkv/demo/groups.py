"""What moved per KV-cache group: the demo's answer to "does a sliding-window or state
group move only what its layers need?".

Every block of every group takes one primary row of `block_bytes` and travels as one
(tiers store whole rows), so bytes moved are blocks x `block_bytes`; `payload_bytes`
is how much of a row holds the group's data (a state group's states are far smaller
than the attention group's KV, and the rest of their rows is padding).

In a hybrid model the full-attention group is the natural yardstick: same tokens per
block, and as many layers as the other kind (layers alternate), so the full group's
traffic is what the window layers would move if they were full-attention layers of
the same size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tierkv.layout import KVLayout


class _Record(Protocol):
    group_loaded: list[int]
    group_stored: list[int]


class _Engine(Protocol):
    @property
    def layout(self) -> KVLayout: ...
    @property
    def layers_per_group(self) -> tuple[int, ...]: ...
    def payload_bytes(self) -> list[int]: ...


def group_report(engine: _Engine, records: Sequence[_Record]) -> list[dict[str, Any]]:
    """Per group of `engine`'s layout: kind, layers, blocks and bytes loaded and stored
    over `records` (the tierkv column's turns)."""
    layout = engine.layout
    block_bytes = int(layout.block_bytes)
    layers, payload = engine.layers_per_group, engine.payload_bytes()
    out = []
    for g, spec in enumerate(layout.groups):
        loaded = sum(r.group_loaded[g] for r in records if g < len(r.group_loaded))
        stored = sum(r.group_stored[g] for r in records if g < len(r.group_stored))
        out.append(
            {
                "group": g,
                "kind": spec.kind,
                "window_tokens": spec.window,
                "layers": layers[g],
                "payload_bytes": payload[g],
                "blocks_loaded": loaded,
                "bytes_loaded": loaded * block_bytes,
                "blocks_stored": stored,
                "bytes_stored": stored * block_bytes,
            }
        )
    return out


def compared_to_full(groups: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Bytes the other group moved as a share of the full group's (hybrid runs with
    both layer kinds in equal numbers only: there the full group is the same size)."""
    if (
        len(groups) != 2
        or groups[0]["kind"] != "full"
        or groups[1]["layers"] != groups[0]["layers"]
    ):
        return None
    full, other = groups
    return {
        "loaded": other["bytes_loaded"] / full["bytes_loaded"] if full["bytes_loaded"] else 0.0,
        "stored": other["bytes_stored"] / full["bytes_stored"] if full["bytes_stored"] else 0.0,
    }


def describe_group(group: dict[str, Any]) -> str:
    """`full`, `sliding_window (96 tokens)`, `state`."""
    kind = str(group["kind"])
    return f"{kind} ({group['window_tokens']} tokens)" if group.get("window_tokens") else kind
