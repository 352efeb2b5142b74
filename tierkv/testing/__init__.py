"""Test scaffolding for tiers (needs the `testing` extra: pytest, hypothesis).

- `TierConformanceSuite` and its helpers (`tierkv.testing.conformance`): one import
  proves a tier keeps the contract.
- `FaultyTier` (`tierkv.testing.faulty`): a memory tier that misbehaves on request.
- `tiny_disk`, `immutable` (`tierkv.testing.disk_faults`): real disk faults (a tmpfs
  that fills up, `chattr +i`) that clear again, for recovery tests (need root).
- `LocalServer`, `free_port`, `missing_server` (`tierkv.testing.servers`): what the
  tier packages' test servers (redis-server, moto, a fault proxy) share.

Nothing in the cache imports this package. Names load on first use, so a benchmark
script that only starts a test server needs neither pytest nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "CTX": "tierkv.testing.conformance",
    "TierConformanceSuite": "tierkv.testing.conformance",
    "assert_partition": "tierkv.testing.conformance",
    "fill_slots": "tierkv.testing.conformance",
    "random_keys": "tierkv.testing.conformance",
    "FaultyTier": "tierkv.testing.faulty",
    "FaultyTierConfig": "tierkv.testing.faulty",
    "DiskFaultUnavailable": "tierkv.testing.disk_faults",
    "immutable": "tierkv.testing.disk_faults",
    "tiny_disk": "tierkv.testing.disk_faults",
    "LocalServer": "tierkv.testing.servers",
    "free_port": "tierkv.testing.servers",
    "missing_server": "tierkv.testing.servers",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from tierkv.testing.conformance import CTX as CTX
    from tierkv.testing.conformance import TierConformanceSuite as TierConformanceSuite
    from tierkv.testing.conformance import assert_partition as assert_partition
    from tierkv.testing.conformance import fill_slots as fill_slots
    from tierkv.testing.conformance import random_keys as random_keys
    from tierkv.testing.disk_faults import DiskFaultUnavailable as DiskFaultUnavailable
    from tierkv.testing.disk_faults import immutable as immutable
    from tierkv.testing.disk_faults import tiny_disk as tiny_disk
    from tierkv.testing.faulty import FaultyTier as FaultyTier
    from tierkv.testing.faulty import FaultyTierConfig as FaultyTierConfig
    from tierkv.testing.servers import LocalServer as LocalServer
    from tierkv.testing.servers import free_port as free_port
    from tierkv.testing.servers import missing_server as missing_server
