"""`layout: slab` keeps the tier contract: tierkv's conformance suite on a real slab
file, once per I/O engine (the conftest's `io_engine`)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, slabfile
from tierkv_nvme.slab import SlabNvmeTier

from tierkv.contract.framing import header_length
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryView
from tierkv.testing import TierConformanceSuite
from tierkv.tier import SecondaryTierManager

_dirs = itertools.count()


class TestSlabTierConformance(TierConformanceSuite):
    """Each tier on a directory of its own (the property-based test opens many)."""

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path, io_engine: str) -> None:
        self.root = tmp_path
        self.io_engine = io_engine

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        engine = self.io_engine
        config = NvmeTierConfig(
            type="nvme",
            path=self.root / f"tier{next(_dirs)}",
            capacity=(capacity_blocks or 1024) * slabfile.slot_bytes(primary.block_bytes),
            io_concurrency=4,
            layout="slab",
            **{"io_engine": engine, **fields},
        )
        tier = NvmeTier(config, primary)
        assert isinstance(tier, SlabNvmeTier)
        return tier

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        """Flip the last payload byte of the key's slot."""
        assert isinstance(tier, SlabNvmeTier)
        block = tier.primary.block_bytes
        index, at = slabfile.locate(tier._index[key].place, slabfile.room_for(block))
        fd = os.open(tier.slab_paths[index], os.O_RDWR)
        try:
            last = os.pread(fd, 1, at + block - 1)[0]
            os.pwrite(fd, bytes([last ^ 0xFF]), at + block - 1)
        finally:
            os.close(fd)

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        """Put `frame` (header + payload) in the slot that holds `key`."""
        assert isinstance(tier, SlabNvmeTier)
        room = slabfile.room_for(tier.primary.block_bytes)
        index, at = slabfile.locate(tier._index[key].place, room)
        size = header_length(frame)
        fd = os.open(tier.slab_paths[index], os.O_RDWR)
        try:
            os.pwrite(fd, frame[size:], at)
            os.pwrite(fd, slabfile.seal(frame[:size], 1 << 40), at + room)
        finally:
            os.close(fd)
