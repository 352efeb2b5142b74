"""Events a tier emits when blocks appear in it or leave it.

An inference server forwards these to its KV-events stream (the router that routes
requests by cache locality reads them). No block size field: a key names the block.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.contract.keys import OffloadKey


@dataclass(frozen=True)
class OffloadingEvent:
    """`keys` were stored in (`removed=False`) or removed from (`removed=True`) `medium`."""

    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool
