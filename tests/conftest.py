"""Shared fixtures for the core tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierkv.registry import register_tier, unregister_tier
from tierkv.testing import FaultyTier


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def faulty_tier_type() -> Iterator[str]:
    """Makes `type: faulty` (tierkv.testing.FaultyTier) available to configs."""
    register_tier(FaultyTier)
    yield "faulty"
    unregister_tier("faulty")
