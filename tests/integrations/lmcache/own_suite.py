"""A pytest plugin that runs LMCache's own L2 adapter tests with the tierkv adapter in
place of their mock adapter.

LMCache 0.5.6's sdist ships `tests/v1/distributed/test_mock_l2_adapter.py`, the
interface tests of an L2 adapter (event fds, store, lookup and lock, unlock, load,
delete, usage by cache salt, listeners), written against `MockL2Adapter(config)`.
This plugin swaps that name, in every collected module, for a factory building
`TierkvL2Adapter` over a fresh nvme tier:

    bash scripts/lmcache-own-tests.sh /path/to/lmcache-0.5.6.tar.gz

which copies that test file and its conftest out of the sdist and runs them with
`-p own_suite` (this file's folder on the path). 43 of the 44 pass. The usage tests
(`usage_fraction` 0 when empty, above 0 after a store, 0 after a delete) pass since
the adapter declares its chain's capacity (here the nvme tier's 64 MiB; the mock's
`config` and its capacity are not read). The one left, `test_store_completion_is_
delayed_by_bandwidth`, asks a store to take over 0.1 s under the mock's simulated
slow bandwidth: tierkv simulates none, its store ends when the disk has the bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest

_made: list[str] = []


def tierkv_adapter(config: Any = None) -> Any:
    """`MockL2Adapter(config)`'s stand-in: tierkv's adapter over an nvme tier."""
    from tierkv.integrations.lmcache import TierkvL2Adapter

    path = tempfile.mkdtemp(prefix="tierkv-lmcache-suite-")
    _made.append(path)
    return TierkvL2Adapter({"tiers": [{"type": "nvme", "path": path, "capacity": "64MiB"}]})


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "MockL2Adapter"):
            module.MockL2Adapter = tierkv_adapter


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
