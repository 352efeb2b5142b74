"""Blocks of several regions (`StridedView`): one file per block, its frame the same as
that of the regions' joined bytes, read straight back into the regions."""

from __future__ import annotations

import mmap
import random
from pathlib import Path

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, blockfile

from tierkv.contract.framing import Framer
from tierkv.contract.jobs import JobMetadata
from tierkv.contract.slab import StridedView
from tierkv.testing import random_keys

pytestmark = pytest.mark.anyio
REGION = 4096
PAGES = 16  # slots; the V half starts PAGES regions after the K half


def strided(buffer: object, offset: int = 0) -> StridedView:
    """K and V halves of one buffer, as an SGLang page_first host pool lays them out."""
    data = memoryview(buffer)[offset : offset + 2 * PAGES * REGION]  # type: ignore[arg-type]
    return StridedView(data, REGION, 2, PAGES * REGION, "regions-test")


def fill(view: StridedView, slots: list[int], rng: random.Random) -> list[bytes]:
    joined = []
    for slot in slots:
        k, v = view.regions(slot)
        k[:], v[:] = rng.randbytes(REGION), rng.randbytes(REGION)
        joined.append(bytes(k) + bytes(v))
    return joined


def wipe(view: StridedView, slots: list[int]) -> None:
    for slot in slots:
        for region in view.regions(slot):
            region[:] = bytes(REGION)


def read_back(view: StridedView, slots: list[int]) -> list[bytes]:
    return [b"".join(bytes(r) for r in view.regions(slot)) for slot in slots]


@pytest.mark.parametrize(("offset", "through_scratch"), [(0, False), (64, True), (200, False)])
async def test_a_two_region_block_is_one_file_and_reads_back_byte_identical(
    tmp_path: Path, offset: int, through_scratch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offsets put the regions at distances from their file offsets (a 54-byte header
    here) that are read straight in, or through the scratch buffer (64: 10 bytes,
    a slow-copy distance, `blockfile.SHORT_DISTANCE`)."""
    scratch_frames: list[object] = []  # frames placed in the scratch buffer
    real_place = blockfile._Scratch._place

    def place(self: blockfile._Scratch, distance: int, head_bytes: int, length: int) -> object:
        got = real_place(self, distance, head_bytes, length)
        scratch_frames.append(got)
        return got

    monkeypatch.setattr(blockfile._Scratch, "_place", place)
    buffer = mmap.mmap(-1, 2 * PAGES * REGION + 4096)
    view = strided(buffer, offset)
    rng = random.Random(offset)
    keys = random_keys(6, rng)
    config = NvmeTierConfig(
        type="nvme", layout="files", path=tmp_path, capacity="64MiB", io_engine="python"
    )
    tier = NvmeTier(config, view)  # the Python path's scratch buffer (test_nvme_native's too)
    await tier.open()
    try:
        joined = fill(view, list(range(6)), rng)
        result = await tier.store(JobMetadata(1, tuple(keys), tuple(range(6))))
        assert set(result.ok_keys) == set(keys)
        files = sorted(p for p in tier.directory.glob("*/*") if p.is_file())
        assert len(files) == 6  # one file per block, not one per region
        framer = Framer(view.namespace)
        assert tier.path_of(keys[2]).read_bytes() == framer.encode(keys[2], joined[2])
        wipe(view, list(range(8, 14)))
        result = await tier.load(JobMetadata(2, tuple(keys), tuple(range(8, 14))))
        assert set(result.ok_keys) == set(keys)
        assert read_back(view, list(range(8, 14))) == joined
        assert bool(scratch_frames) == through_scratch
    finally:
        await tier.close()
        view.release()


async def test_a_changed_byte_in_the_second_region_fails_the_block(tmp_path: Path) -> None:
    view = strided(bytearray(2 * PAGES * REGION))
    rng = random.Random(1)
    [key] = random_keys(1, rng)
    tier = NvmeTier(
        NvmeTierConfig(type="nvme", layout="files", path=tmp_path, capacity="64MiB"), view
    )
    await tier.open()
    try:
        fill(view, [0], rng)
        await tier.store(JobMetadata(1, (key,), (0,)))
        path = tier.path_of(key)
        data = bytearray(path.read_bytes())
        data[-100] ^= 1  # in V, the second region
        path.write_bytes(bytes(data))
        result = await tier.load(JobMetadata(2, (key,), (5,)))
        assert result.failed_keys == (key,) and "checksum" in str(result.error)
        assert not path.exists()  # a corrupt block is deleted
    finally:
        await tier.close()
