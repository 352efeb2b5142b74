"""The nvme tier keeps the tier contract: tierkv's conformance suite, on a real disk."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, disk_footprint

from tierkv.contract.framing import header_bytes
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryView
from tierkv.testing import TierConformanceSuite
from tierkv.tier import SecondaryTierManager

_dirs = itertools.count()


class TestNvmeTierConformance(TierConformanceSuite):
    """Every tier the suite makes gets a directory of its own: the property-based test
    opens many tiers in one test, and each must start empty. Run once per I/O engine
    (the conftest's `io_engine`)."""

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path, io_engine: str) -> None:
        self.root = tmp_path
        self.io_engine = io_engine

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        block = disk_footprint(header_bytes(b"k" * 20) + primary.block_bytes)
        config = NvmeTierConfig(
            type="nvme",
            path=self.root / f"tier{next(_dirs)}",
            capacity=(capacity_blocks or 1024) * block,
            io_concurrency=4,
            layout="files",
            **{"io_engine": self.io_engine, **fields},
        )
        return NvmeTier(config, primary)

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        assert isinstance(tier, NvmeTier)
        path = tier.path_of(key)
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the last payload byte
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0xFF]))

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        assert isinstance(tier, NvmeTier)
        tier.path_of(key).write_bytes(frame)
