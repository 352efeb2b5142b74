"""Shared by the `tierkv` command's tests: a tier type that cannot open."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierkv.memory_tier import MemoryTier
from tierkv.registry import register_tier, unregister_tier


class BrokenTier(MemoryTier):
    """Fails to open, as an unreachable server does."""

    @staticmethod
    def get_tier_type() -> str:
        return "broken"

    async def open(self) -> None:
        raise ConnectionRefusedError("connection refused by 127.0.0.1:1")


@pytest.fixture
def broken_tier() -> Iterator[str]:
    register_tier(BrokenTier)
    yield "broken"
    unregister_tier("broken")
