"""A real Mooncake Store for the mooncake tier's tests: `mooncake_master` on free
loopback ports, and a second process holding a segment, so the blocks a tier stores
live in another process's memory.

Outside CI a missing binding (or its system libraries) skips these tests with the
install hint; with CI=true it fails them: CI must have installed it
(requirements-dev.txt, scripts/setup-servers.sh).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tierkv_mooncake.testing import MooncakeMaster, MooncakeMissing, SegmentHolder

from tierkv.testing import missing_server

SEGMENT = 256 << 20


def _master(**kwargs: int) -> MooncakeMaster:
    try:
        return MooncakeMaster(**kwargs)
    except MooncakeMissing as exc:
        missing_server("Mooncake Store (mooncake_master and its binding)", exc)


@pytest.fixture(scope="session")
def mooncake_store() -> Iterator[MooncakeMaster]:
    """One master for the session, with a holder process lending a 256 MiB segment."""
    with _master() as master, SegmentHolder(master, SEGMENT):
        yield master


@pytest.fixture
def fresh_master() -> Iterator[MooncakeMaster]:
    """A master of this test's own (no holder: the test starts what it needs); short
    leases, so the store can evict what a test just wrote."""
    with _master(lease_ttl_ms=200) as master:
        yield master


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
