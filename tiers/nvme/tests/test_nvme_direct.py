"""`direct: true`: the slab's slots moved with O_DIRECT where a block's memory allows.

What it must keep: a slot written one way reads the same bytes the other way (O_DIRECT
on or off, the core or the Python path, the rebuild's buffered scan), a block whose
memory is not whole 4 KiB aligned pages still round-trips (buffered), the header-only
rewrites (a stale load's new sequence) and punched holes stay coherent with direct
I/O, and `data_path` says whether O_DIRECT is in use and why not. Where the
filesystem of the test directory refuses O_DIRECT, the tier must stay buffered and
say so; the assertions on `data_path` follow what the filesystem does."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierkv_nvme import NvmeTier, NvmeTierConfig, native, slabfile
from tierkv_nvme.slab import SlabNvmeTier

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.slab import PrimaryView, StridedView
from tierkv.testing import random_keys

pytestmark = pytest.mark.anyio
Rig = Any  # the conftest's Rig (the `make_rig` fixture)


def direct_opens(path: Path) -> bool:
    """Whether the filesystem under `path` opens files with O_DIRECT."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / "direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def page_cached(path: Path) -> bool:
    """Whether the filesystem keeps a direct write in the page cache (tmpfs: its pages
    are the page cache)."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return kind.stdout.strip() in ("tmpfs", "ramfs")


def slab_tier(rig: Rig, slots: int = 64, **fields: Any) -> SlabNvmeTier:
    fields.setdefault("io_engine", "native")
    tier = rig.tier(capacity=slots * slabfile.slot_bytes(rig.block_bytes), layout="slab", **fields)
    assert isinstance(tier, SlabNvmeTier)
    return tier


async def stored(rig: Rig, n: int, **fields: Any) -> tuple[list[bytes], dict[bytes, bytes]]:
    """Store n blocks in a new tier (closed again); their keys and bytes."""
    tier = slab_tier(rig, **fields)
    await tier.open()
    keys = rig.keys(n)
    result, data = await rig.store(tier, keys)
    assert result.ok, result.error
    await tier.close()
    return keys, data


async def assert_loads(tier: SlabNvmeTier, rig: Rig, data: dict[bytes, bytes]) -> None:
    keys = list(data)
    result, got = await rig.load(tier, keys)
    assert result.ok, result.error
    assert got == data


# -- the config -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"layout": "files"}, "set layout: slab, or direct: false"),
        ({"io_engine": "python"}, "set io_engine: auto (or native), or direct: false"),
    ],
)
def test_direct_is_refused_where_it_would_do_nothing(fields: dict[str, str], fix: str) -> None:
    with pytest.raises(ValueError, match="direct: true") as caught:
        NvmeTierConfig(type="nvme", path="/x", capacity="1GiB", direct=True, **fields)
    assert fix in str(caught.value)


def test_direct_is_off_unless_asked_for() -> None:
    assert NvmeTierConfig(type="nvme", path="/x", capacity="1GiB").direct is False


# -- the same bytes either way ----------------------------------------------------------


@pytest.mark.parametrize("block_bytes", [4096, 65536, 5000])
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"direct": True}, {"direct": False}),
        ({"direct": False}, {"direct": True}),
        ({"direct": True}, {"io_engine": "python"}),
        ({"io_engine": "python"}, {"direct": True}),
    ],
)
async def test_a_slot_written_one_way_reads_the_same_bytes_the_other(
    tmp_path: Path, make_rig: type, native_core: None, block_bytes: int,
    first: dict[str, Any], second: dict[str, Any],
) -> None:  # fmt: skip
    rig = make_rig(tmp_path / "nvme", block_bytes=block_bytes, io_engine="native")
    _keys, data = await stored(rig, 12, fsync="always", **first)
    tier = slab_tier(rig, **second)
    await tier.open()
    assert len(tier) == 12  # the rebuild's buffered scan found every direct write
    await assert_loads(tier, rig, data)
    await tier.close()


async def test_a_direct_tier_says_so_and_leaves_the_page_cache_alone(
    tmp_path: Path, make_rig: type, native_core: None
) -> None:
    rig = make_rig(tmp_path / "nvme", block_bytes=16384, io_engine="native")
    tier = slab_tier(rig, direct=True)
    await tier.open()
    if not direct_opens(tmp_path / "probe"):
        assert (tier.data_path or "").startswith(
            "native, buffered (direct unused: the filesystem refuses O_DIRECT"
        )
        await tier.close()
        pytest.skip("the test directory's filesystem refuses O_DIRECT")
    assert tier.data_path == "native, O_DIRECT"
    assert tier.describe()["direct"] is True
    keys = rig.keys(4)
    result, data = await rig.store(tier, keys)
    assert result.ok, result.error
    await assert_loads(tier, rig, data)
    if not page_cached(tmp_path):  # the payload went past the cache: not cached now
        index, offset = slabfile.locate(tier._index[keys[0]].place, 16384)
        fd = os.open(tier.slab_paths[index], os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                os.preadv(fd, [bytearray(16384)], offset, os.RWF_NOWAIT)
        finally:
            os.close(fd)
    await tier.close()


async def test_direct_off_keeps_the_data_path_as_it_was(
    tmp_path: Path, make_rig: type, native_core: None
) -> None:
    rig = make_rig(tmp_path / "nvme", io_engine="native")
    tier = slab_tier(rig)
    await tier.open()
    assert tier.data_path == "native" and tier.describe()["direct"] is False
    await tier.close()


# -- blocks whose memory is not whole aligned pages --------------------------------------


async def test_a_block_size_off_the_page_goes_buffered_and_says_why(
    tmp_path: Path, make_rig: type, native_core: None
) -> None:
    rig = make_rig(tmp_path / "nvme", block_bytes=5000, io_engine="native")
    tier = slab_tier(rig, direct=True)
    await tier.open()
    assert tier.data_path is not None and tier.data_path.startswith("native, buffered")
    if direct_opens(tmp_path / "probe"):
        assert "not whole 4 KiB aligned pages" in tier.data_path
    result, data = await rig.store(tier, rig.keys(6))
    assert result.ok, result.error
    await assert_loads(tier, rig, data)
    await tier.close()


@pytest.mark.parametrize(("region_bytes", "aligned"), [(4096, True), (2048, False), (3000, False)])
async def test_a_region_view_round_trips_direct_where_aligned_else_buffered(
    tmp_path: Path, native_core: None, region_bytes: int, aligned: bool
) -> None:
    half = 16 * 8192  # 16 slots of two regions, each half of a page-aligned buffer
    memory = mmap.mmap(-1, 2 * half)
    view = StridedView(memory, region_bytes, 2, half, "regions")
    block = view.block_bytes
    config = NvmeTierConfig(
        type="nvme", path=tmp_path / "nvme", capacity=32 * slabfile.slot_bytes(block),
        layout="slab", io_engine="native", direct=True,
    )  # fmt: skip
    tier = NvmeTier(config, view)
    assert isinstance(tier, SlabNvmeTier)
    await tier.open()
    assert view.lanes is not None and native.direct_aligned(view.lanes) is aligned
    if direct_opens(tmp_path / "probe"):
        assert ("O_DIRECT" in (tier.data_path or "")) is aligned
    keys = random_keys(6, random.Random(region_bytes))
    data = []
    for slot in range(6):
        payload = random.Random(slot).randbytes(block)
        first, second = view.regions(slot)
        first[:] = payload[:region_bytes]
        second[:] = payload[region_bytes:]
        data.append(payload)
    stored_ = await tier.store(JobMetadata(1, tuple(keys), tuple(range(6))))
    assert stored_.ok, stored_.error
    for slot in range(8, 14):
        for region in view.regions(slot):
            region[:] = bytes(region_bytes)
    loaded = await tier.load(JobMetadata(2, tuple(keys), tuple(range(8, 14))))
    assert loaded.ok, loaded.error
    for i in range(6):
        assert b"".join(bytes(r) for r in view.regions(8 + i)) == data[i]
    await tier.close()


class LentView(PrimaryView):
    """Blocks lent one by one (LMCache's objects): the core checks each block's memory."""

    @property
    def lanes(self) -> None:  # type: ignore[override]
        return None


@pytest.mark.parametrize("aligned", [True, False])
async def test_lent_blocks_go_direct_each_where_its_memory_is_aligned(
    tmp_path: Path, native_core: None, aligned: bool
) -> None:
    block = 8192
    memory = mmap.mmap(-1, 33 * block)
    view = LentView(memoryview(memory)[0 if aligned else 512 :][: 32 * block], block, "lent")
    config = NvmeTierConfig(
        type="nvme", path=tmp_path / "nvme", capacity=32 * slabfile.slot_bytes(block),
        layout="slab", io_engine="native", direct=True,
    )  # fmt: skip
    tier = NvmeTier(config, view)
    assert isinstance(tier, SlabNvmeTier)
    await tier.open()
    if direct_opens(tmp_path / "probe"):
        assert tier.data_path == "native-blocks, O_DIRECT where a block's memory is 4 KiB aligned"
    keys = random_keys(5, random.Random(7))
    for slot in range(5):
        view.block(slot)[:] = random.Random(slot).randbytes(block)
    assert (await tier.store(JobMetadata(1, tuple(keys), tuple(range(5))))).ok
    loaded = await tier.load(JobMetadata(2, tuple(keys), tuple(range(16, 21))))
    assert loaded.ok, loaded.error
    for i in range(5):
        assert bytes(view.block(16 + i)) == random.Random(i).randbytes(block)
    await tier.close()
    view.release()


# -- coherence of the other writes --------------------------------------------------------


async def test_a_stale_direct_load_rewrites_the_sequence_a_buffered_scan_sees(
    tmp_path: Path, make_rig: type, native_core: None
) -> None:
    rig = make_rig(tmp_path / "nvme", block_bytes=8192, io_engine="native")
    tier = slab_tier(rig, direct=True)
    await tier.open()
    keys = rig.keys(3)
    result, data = await rig.store(tier, keys)
    assert result.ok, result.error
    tier._index[keys[0]].touched_ns = 0  # stale: this load rewrites its header page
    loaded, _ = await rig.load(tier, keys[:1])
    assert loaded.ok, loaded.error
    await tier.close()
    for fields in ({"direct": False}, {"io_engine": "python"}, {"direct": True}):
        again = slab_tier(rig, **fields)
        await again.open()
        assert list(again._index) == [keys[1], keys[2], keys[0]], fields
        await assert_loads(again, rig, data)
        await again.close()


async def test_a_block_removed_under_direct_io_stays_gone_and_its_slot_takes_a_new_one(
    tmp_path: Path, make_rig: type, native_core: None
) -> None:
    rig = make_rig(tmp_path / "nvme", block_bytes=4096, io_engine="native")
    tier = slab_tier(rig, slots=8, direct=True)
    await tier.open()
    keys = rig.keys(4)
    result, data = await rig.store(tier, keys)
    assert result.ok, result.error
    place = tier._index[keys[0]].place
    await tier.remove(keys[:1])  # a hole punched through the buffered descriptor
    newer = rig.keys(1)
    result, more = await rig.store(tier, newer, first_slot=4)
    assert result.ok, result.error
    assert tier._index[newer[0]].place == place  # the freed slot, written direct
    await tier.close()
    again = slab_tier(rig, slots=8, direct=False)
    await again.open()
    assert keys[0] not in again._index
    await assert_loads(again, rig, {**{k: data[k] for k in keys[1:]}, **more})
    await again.close()


# -- the filesystem refuses it ---------------------------------------------------------


async def test_a_filesystem_that_refuses_o_direct_leaves_the_tier_buffered_logged_once(
    tmp_path: Path, make_rig: type, native_core: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    def refuse(fd: int, index: int, dir_fd: int) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(slabfile, "open_direct", refuse)
    rig = make_rig(tmp_path / "nvme", block_bytes=4096, io_engine="native")
    tier = slab_tier(rig, direct=True)
    with caplog.at_level(logging.WARNING, logger="tierkv_nvme.slab"):
        await tier.open()
    assert tier.data_path == (
        "native, buffered (direct unused: the filesystem refuses O_DIRECT (Invalid argument))"
    )
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    result, data = await rig.store(tier, rig.keys(3))
    assert result.ok, result.error
    await assert_loads(tier, rig, data)
    await tier.close()


async def test_a_tier_that_falls_back_to_python_says_why_direct_is_unused(
    tmp_path: Path, make_rig: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setattr(native, "reason", "the core is not built (a test)")
    rig = make_rig(tmp_path / "nvme", io_engine="auto")
    tier = slab_tier(rig, io_engine="auto", direct=True)
    await tier.open()
    assert tier.data_path == "python, buffered (direct unused: the core is not built (a test))"
    await tier.close()


async def test_a_signing_tier_moves_its_blocks_with_o_direct(
    tmp_path: Path, make_rig: type, native_core: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERKV_TEST_MAC", "k" * 32)
    rig = make_rig(tmp_path / "nvme", io_engine="native")
    tier = slab_tier(rig, io_engine="native", direct=True, mac_key_env="TIERKV_TEST_MAC")
    await tier.open()
    if not (tier.data_path or "").endswith("O_DIRECT"):
        await tier.close()
        pytest.skip(f"no O_DIRECT here: {tier.data_path}")
    result, data = await rig.store(tier, rig.keys(5))
    assert result.ok, result.error
    await assert_loads(tier, rig, data)
    await tier.close()


# -- any block size ----------------------------------------------------------------------


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    block_bytes=st.one_of(
        st.integers(1, 6).map(lambda pages: pages * 4096), st.integers(1, 3 * 4096)
    ),
    ways=st.lists(st.sampled_from(["direct", "buffered", "python"]), min_size=2, max_size=3),
    n=st.integers(1, 9),
)
def test_what_was_stored_reads_back_whole_or_is_a_miss_whatever_the_block_size(
    make_rig: type, native_core: None, block_bytes: int, ways: list[str], n: int
) -> None:
    import anyio

    fields = {
        "direct": {"direct": True},
        "buffered": {"direct": False},
        "python": {"io_engine": "python"},
    }

    async def run(root: Path) -> None:
        rig = make_rig(root / "nvme", block_bytes=block_bytes, io_engine="native")
        held: dict[bytes, bytes] = {}
        for step, way in enumerate(ways):
            tier = slab_tier(rig, slots=16, fsync="never", **fields[way])
            await tier.open()
            keys = rig.keys(n)
            result, data = await rig.store(tier, keys)
            assert result.ok, result.error
            held.update(data)
            # 16 slots: older blocks may have been evicted (a miss); the others load
            # whole, whichever way each was written
            present = [key for key in held if key in tier._index]
            assert set(data) <= set(present)
            loaded, got = await rig.load(tier, present, first_slot=16)
            assert loaded.ok, (step, way, loaded.error)
            assert got == {key: held[key] for key in present}, (step, way)
            await tier.close()

    with tempfile.TemporaryDirectory() as root:
        anyio.run(run, Path(root))
