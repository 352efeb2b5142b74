"""A real S3 API for the s3 tier's tests: moto's standalone server on loopback, one
bucket, and a fault-injecting proxy in front of it per test.

Outside CI a missing moto[server] skips these tests with the install hint; with CI=true
it fails them: CI must have installed it (requirements-dev.txt).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tierkv_s3.testing import FaultProxy, MotoMissing, MotoServer

from tierkv.testing import missing_server

BUCKET = "tierkv-tests"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    try:
        server = MotoServer()
    except MotoMissing as exc:
        missing_server("moto's S3 server", exc)
    with server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the shared moto server, no faults set."""
    with FaultProxy(moto_server.endpoint_url) as fault_proxy:
        yield fault_proxy


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
