"""What the conformance mixins (`claims.py`, `candidates.py`) use of the suite they are
mixed into: its hooks (`view`, `job`, `opened`), declared once here so that each mixin
type-checks alone, and `_fill`, the helper both need.

`TierConformanceSuite` (`conformance.py`) provides the hooks; a mixin never runs
without it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import SecondaryTierManager


def new_keys(n: int) -> list[OffloadKey]:
    """`n` random keys, unknown to any tier."""
    return [make_offload_key(os.urandom(16), 0) for _ in range(n)]


class SuiteHooks:
    """The hooks of `TierConformanceSuite` a mixin calls, and `_fill`."""

    supports_capacity: ClassVar[bool]

    # -- provided by TierConformanceSuite ---------------------------------------------
    def view(self) -> PrimaryView:
        raise NotImplementedError

    def job(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> JobMetadata:
        raise NotImplementedError

    def opened(
        self, view: PrimaryView, capacity_blocks: int | None = None, **fields: Any
    ) -> AbstractAsyncContextManager[SecondaryTierManager]:
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------
    async def _fill(
        self, tier: SecondaryTierManager, view: PrimaryView, n: int, first: int = 0
    ) -> dict[OffloadKey, bytes]:
        """Store `n` new blocks one job each (oldest first); their bytes by key."""
        rng = random.Random(first)
        stored: dict[OffloadKey, bytes] = {}
        for i, key in enumerate(new_keys(n)):
            slot = (first + i) % 8
            payload = rng.randbytes(view.block_bytes)
            view.block(slot)[:] = payload
            result = await tier.store(self.job([key], [slot]))
            assert result.ok, result.error
            stored[key] = payload
        return stored
