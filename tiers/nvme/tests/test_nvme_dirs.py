"""The fan-out directory descriptors the tier keeps (`dirs.py`) and the read path's
shortcuts (`blockfile.read_blocks`: page cache first, a scratch buffer for slots at a
slow copy distance): bounded, closed at `close`, checked against the names on disk,
and never a way around the integrity checks."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import blockfile, dirs
from tierkv_nvme.layout import block_relpath

from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.tier import CorruptBlock, TierUnavailable

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-dirs")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fanouts(keys: list[OffloadKey]) -> int:
    return len({block_relpath(k)[0] for k in keys})


async def test_descriptors_are_kept_per_fanout_directory_and_closed_at_close(rig) -> None:
    before = open_fds()
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(12)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    for _ in range(3):  # reads and writes reuse them: no more than one per directory
        result, got = await rig.load(tier, keys)
        assert result.ok and got == data
    if tier.describe()["batch_calls"]:  # opened below the namespace dir: none kept
        assert len(tier._dirs) == 0
        assert open_fds() <= before + 2 + 1
    else:
        assert len(tier._dirs) == fanouts(keys)
        assert open_fds() <= before + fanouts(keys) + 2 + 1  # + the lock and the namespace dir
    await tier.close()
    assert open_fds() == before
    assert len(tier._dirs) == 0


async def test_kept_descriptors_survive_removing_every_block(rig) -> None:
    """`remove` (what SGLang's `clear` calls) deletes files, never the directories: the
    descriptors stay good and no more are opened for the blocks stored after."""
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(8)
    assert (await rig.store(tier, keys))[0].ok
    kept = len(tier._dirs)
    await tier.remove(keys)
    assert rig.files(tier) == []
    assert await tier.lookup(keys, CTX) == [False] * len(keys)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    result, got = await rig.load(tier, keys)
    assert result.ok and got == data
    if tier.describe()["batch_calls"]:  # stores and loads keep none; the deletes did
        assert len(tier._dirs) <= fanouts(keys)
    else:
        assert len(tier._dirs) == kept
    await tier.close()


async def test_a_fanout_directory_replaced_by_another_is_used_by_its_name(rig, tmp_path) -> None:
    """Moved away and replaced by a new directory after its descriptor was kept: the
    next call reads and writes the directory the name holds now, never the old one
    (whose descriptor stays open until `close`, then closes)."""
    before = open_fds()
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    assert (await rig.store(tier, [key]))[0].ok
    first, name = block_relpath(key)
    moved = tmp_path / "moved"
    (tier.directory / first).rename(moved)
    (tier.directory / first).mkdir()

    result, _ = await rig.load(tier, [key])
    assert result.failed_keys == (key,)
    assert "gone" in (result.error or "")
    stored, data = await rig.store(tier, [key], first_slot=2)
    assert stored.ok, stored.error
    assert (tier.directory / first / name).is_file()
    assert sorted(p.name for p in moved.iterdir()) == [name]  # the old one untouched
    result, got = await rig.load(tier, [key])
    assert result.ok and got == data
    await tier.close()
    assert open_fds() == before


async def test_a_fanout_directory_deleted_under_the_tier_is_made_again(rig) -> None:
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    assert (await rig.store(tier, [key]))[0].ok
    first, name = block_relpath(key)
    shutil.rmtree(tier.directory / first)
    result, _ = await rig.load(tier, [key])
    assert result.failed_keys == (key,)
    stored, data = await rig.store(tier, [key], first_slot=3)
    assert stored.ok, stored.error
    assert (tier.directory / first / name).is_file()
    result, got = await rig.load(tier, [key])
    assert result.ok and got == data
    await tier.close()


async def test_past_the_process_budget_directories_are_opened_per_call(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no descriptors left in the process's budget (a quarter of RLIMIT_NOFILE)
    nothing is kept: every call opens what it needs and closes it, and works."""
    monkeypatch.setattr(dirs, "fd_budget", lambda: 0)
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(6)
    baseline = open_fds()
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    result, got = await rig.load(tier, keys)
    assert result.ok and got == data
    assert len(tier._dirs) == 0
    assert open_fds() == baseline
    await tier.close()


def test_the_budget_is_a_quarter_of_the_open_file_limit() -> None:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert dirs.fd_budget() == soft // 4


# -- the read path ---------------------------------------------------------------------
def at_distance(rig, tier, key: OffloadKey, distance: int) -> tuple[mmap.mmap, memoryview]:
    """A destination for `key`'s payload placed `distance` bytes after its file
    offset, modulo a page."""
    head = tier.framer.header_bytes(key)
    area = mmap.mmap(-1, 4 * mmap.PAGESIZE + rig.block_bytes)
    start = mmap.PAGESIZE + (head + distance) % mmap.PAGESIZE
    return area, memoryview(area)[start : start + rig.block_bytes]


def read(
    tier, items: list[blockfile.ReadItem], placement: tuple[int, int] = (1, 0)
) -> list[Exception | None]:
    """`read_blocks` of `items`, whose slots lie as `placement` says (by default
    unknown: each slot's distance is tested)."""
    with tier._dirs.leaves() as leaves:
        return blockfile.read_blocks(leaves, items, tier.framer, placement)


async def test_large_slots_are_read_straight_in_at_any_distance(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over SCRATCH_MAX_BYTES a fresh scratch buffer costs more than the slow copy."""
    monkeypatch.setattr(blockfile, "SCRATCH_MAX_BYTES", rig.block_bytes - 1)
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    stored, data = await rig.store(tier, [key])
    assert stored.ok
    area, dest = at_distance(rig, tier, key, 8)
    assert blockfile._Scratch().frame(dest, tier.framer.header_bytes(key)) is None
    assert read(tier, [(tier.rel_of(key), key, dest, False)]) == [None]
    assert bytes(dest) == data[key]
    dest.release()
    area.close()
    await tier.close()


def scratch_frames(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per slot the read tests from now on (`_Scratch.frame`): whether it went through
    the scratch buffer."""
    tested: list[bool] = []
    real = blockfile._Scratch.frame

    def spy(self: Any, dest: memoryview, head_bytes: int) -> Any:
        frame = real(self, dest, head_bytes)
        tested.append(frame is not None)
        return frame

    monkeypatch.setattr(blockfile._Scratch, "frame", spy)
    return tested


@pytest.mark.parametrize("distance", [0, 8, 63, 64, -8])
async def test_a_slot_at_any_distance_from_the_payload_reads_whole(
    rig, distance: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots at a short distance after the payload (1-63 bytes) are read through the
    scratch buffer; every distance reads the same bytes."""
    through = scratch_frames(monkeypatch)
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    stored, data = await rig.store(tier, [key])
    assert stored.ok
    area, dest = at_distance(rig, tier, key, distance)
    assert read(tier, [(tier.rel_of(key), key, dest, False)]) == [None]
    assert bytes(dest) == data[key]
    assert through == [0 < distance % mmap.PAGESIZE < blockfile.SHORT_DISTANCE]
    dest.release()
    area.close()
    await tier.close()


@pytest.mark.parametrize(
    ("placement", "head", "short"),
    [
        ((4096, 64), 54, True),  # SGLang's 64-byte-aligned pool, 20-byte keys: 10 bytes
        ((4096, 64), 64, False),  # the same pool, keys padded to a 64-byte header
        ((4096, 0), 54, False),  # a page-aligned slab: 4,042 bytes
        ((64, 0), 64, False),  # any 64-byte-aligned slot, a 64-byte header
        ((64, 0), 128, False),
        ((64, 0), 70, True),  # some slot is 58 bytes after its payload
        ((128, 0), 64, False),  # 64 or 4,032 bytes: neither is short
        ((32, 0), 64, True),  # too coarse to tell
        ((1, 0), 64, True),  # the address is not known
    ],
)
def test_whether_a_slot_can_lie_at_a_short_distance(
    placement: tuple[int, int], head: int, short: bool
) -> None:
    assert blockfile.short_distance_possible(placement, head) is short


@pytest.mark.parametrize("distance", [0, 8, 64])
async def test_slots_placed_clear_of_short_distances_are_never_tested(
    rig, distance: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told where its slots lie, a read that no slot of can be at a short distance
    tests none; one at such a distance goes through the scratch buffer all the same."""
    tested = scratch_frames(monkeypatch)
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    stored, data = await rig.store(tier, [key])
    assert stored.ok
    head = tier.framer.header_bytes(key)
    area, dest = at_distance(rig, tier, key, distance)
    placement = (mmap.PAGESIZE, (head + distance) % mmap.PAGESIZE)
    assert read(tier, [(tier.rel_of(key), key, dest, False)], placement) == [None]
    assert bytes(dest) == data[key]
    assert tested == ([True] if distance == 8 else [])
    dest.release()
    area.close()
    await tier.close()


@pytest.mark.parametrize("change", ["one byte more", "one byte less", "a flipped bit"])
@pytest.mark.parametrize("distance", [8, 64])
async def test_a_bad_file_fails_through_the_scratch_buffer_too(
    rig, change: str, distance: int
) -> None:
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    assert (await rig.store(tier, [key]))[0].ok
    path = tier.path_of(key)
    frame = bytearray(path.read_bytes())
    if change == "a flipped bit":
        frame[-1] ^= 1
    path.write_bytes(
        {"one byte more": frame + b"\0", "one byte less": frame[:-1]}.get(change, frame)
    )
    area, dest = at_distance(rig, tier, key, distance)
    [outcome] = read(tier, [(tier.rel_of(key), key, dest, False)])
    assert isinstance(outcome, CorruptBlock)
    assert not path.exists()
    dest.release()
    area.close()
    await tier.close()


async def test_blocks_not_in_the_page_cache_are_read_after_advice(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block dropped from the page cache fails the cache-only read; it and the rest
    of its group are read after `posix_fadvise(WILLNEED)` together (no second try of
    the cache: a partly cached file would be copied twice); the blocks read from the
    cache before it get no advice."""
    advised: list[int] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append(fd)
        real(fd, offset, length, advice)

    tier = rig.tier()
    await tier.open()
    keys = rig.keys(6)
    stored, data = await rig.store(tier, keys)
    assert stored.ok
    result, got = await rig.load(tier, keys)
    assert result.ok and got == data
    monkeypatch.setattr(os, "posix_fadvise", spy)
    result, got = await rig.load(tier, keys)
    assert result.ok and got == data
    assert advised == []  # all cached: no advice
    for key in keys[3:]:
        fd = os.open(tier.path_of(key), os.O_RDONLY)
        os.fsync(fd)
        real(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    result, got = await rig.load(tier, keys)
    assert result.ok and got == data
    assert len(advised) <= 3  # from the first dropped one on (the kernel may keep some)
    await tier.close()


@pytest.mark.python_io
async def test_a_filesystem_that_refuses_cache_only_reads_is_read_as_before(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.preadv
    refused: list[int] = []

    def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        if flags and flags[0]:
            refused.append(fd)
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(fd, buffers, offset)

    monkeypatch.setattr(blockfile._Cached, "nowait", blockfile._Cached.nowait)
    monkeypatch.setattr(os, "preadv", preadv)
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(4)
    stored, data = await rig.store(tier, keys)
    assert stored.ok
    for _ in range(2):
        result, got = await rig.load(tier, keys)
        assert result.ok and got == data
    assert len(refused) <= 1 and blockfile._Cached.nowait is False
    await tier.close()


def test_leaves_close_what_they_did_not_keep(tmp_path: Path) -> None:
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    kept = dirs.FanoutDirs(root)
    before = open_fds()
    with kept.leaves() as leaves:
        one = leaves.get(("ab",), create=True)
        assert leaves.get(("ab",), create=False) == one
        leaves.get(("ab", "cd"), create=True)  # two levels: not kept, closed at the end
    assert len(kept) == 1 and open_fds() == before + 1
    (tmp_path / "ab").rename(tmp_path / "old")
    (tmp_path / "ab").symlink_to(tmp_path / "old", target_is_directory=True)
    with kept.leaves() as leaves, pytest.raises(OSError) as failed:
        leaves.get(("ab",), create=False)
    assert failed.value.errno == errno.ELOOP
    kept.close()
    assert open_fds() == before and len(kept) == 0
    os.close(root)


def counting_stats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names `os.stat` is asked for from now on (what `FanoutDirs.checked` checks)."""
    asked: list[str] = []
    real = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        asked.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    return asked


def settled_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """`FanoutDirs` sees every timestamp as settled (its clock SETTLED_NS ahead)."""
    real = dirs.time.time_ns
    monkeypatch.setattr(dirs.time, "time_ns", lambda: real() + dirs.SETTLED_NS + 10**9)


def test_kept_directories_are_checked_each_call_while_the_namespace_changed_lately(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The namespace directory was just changed (a fan-out directory made): a change
    in the same clock tick could carry the same timestamps, so every call checks."""
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    kept = dirs.FanoutDirs(root)
    with kept.leaves() as leaves:
        leaves.get(("ab",), create=True)
    asked = counting_stats(monkeypatch)
    for _ in range(3):
        with kept.leaves() as leaves:
            leaves.get(("ab",), create=False)
    assert asked == ["ab", "ab", "ab"]
    kept.close()
    os.close(root)


def test_a_settled_namespace_spares_the_check_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settled and unchanged: a kept directory is checked once, then used as it is;
    a fan-out directory swapped for a link (an entry of the namespace directory
    changed) is noticed by the next call all the same."""
    settled_clock(monkeypatch)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    kept = dirs.FanoutDirs(root)
    with kept.leaves() as leaves:
        first = leaves.get(("ab",), create=True)
    asked = counting_stats(monkeypatch)
    for _ in range(3):
        with kept.leaves() as leaves:
            assert leaves.get(("ab",), create=False) == first
    assert asked == ["ab"], "checked more than once in one settled state"
    (tmp_path / "ab").rename(tmp_path / "old")
    (tmp_path / "ab").symlink_to(tmp_path / "old", target_is_directory=True)
    with kept.leaves() as leaves, pytest.raises(OSError) as failed:
        leaves.get(("ab",), create=False)
    assert failed.value.errno == errno.ELOOP
    kept.close()
    os.close(root)


async def test_a_swapped_fanout_directory_is_never_read_through_a_settled_namespace(
    rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier's own loads, with the namespace directory settled: a fan-out
    directory moved out and replaced by a link fails its key (ELOOP) on the next
    load, and the block outside is neither read nor deleted."""
    settled_clock(monkeypatch)
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    stored, _ = await rig.store(tier, [key])
    assert stored.ok, stored.error
    loaded, _ = await rig.load(tier, [key])  # the directory is checked in this state
    assert loaded.ok, loaded.error
    first, name = block_relpath(key)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tier.directory / first).rename(outside / "moved")
    (tier.directory / first).symlink_to(outside / "moved", target_is_directory=True)
    before = (outside / "moved" / name).read_bytes()
    result, data = await rig.load(tier, [key])
    assert result.failed_keys == (key,)
    assert "symlink" in (result.error or "")
    assert data[key] == bytes(rig.block_bytes), "the load read through the link"
    assert (outside / "moved" / name).read_bytes() == before
    await tier.close()


async def test_blocks_are_read_without_touching_their_access_time(rig) -> None:
    """A load leaves a block file's access time as the store left it (`O_NOATIME`):
    under `relatime` the first read after a write would otherwise write the inode."""
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    stored, data = await rig.store(tier, [key])
    assert stored.ok
    path = tier.path_of(key)
    os.utime(path, ns=(1, os.stat(path).st_mtime_ns))  # long ago: relatime would update it
    result, got = await rig.load(tier, [key])
    assert result.ok and got == data
    assert os.stat(path).st_atime_ns == 1
    await tier.close()


@pytest.mark.python_io
async def test_files_that_refuse_noatime_are_read_all_the_same(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EPERM for `O_NOATIME` (files another user owns): read without it, from then on."""
    refused: list[int] = []
    real_open = os.open

    def fussy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_NOATIME", 0):
            refused.append(flags)
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(blockfile._ReadFlags, "flags", blockfile._ReadFlags.flags)
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(3)
    stored, data = await rig.store(tier, keys)
    assert stored.ok
    monkeypatch.setattr(os, "open", fussy)
    for _ in range(2):
        result, got = await rig.load(tier, keys)
        assert result.ok and got == data
    assert len(refused) == (1 if hasattr(os, "O_NOATIME") else 0)
    await tier.close()


@pytest.mark.parametrize("removed", ["namespace", "path"])
async def test_a_directory_removed_under_the_tier_is_made_anew_and_its_blocks_forgotten(
    rig, removed: str
) -> None:
    """The directory gone (an operator's `rm -rf`, a cleanup job): the next lookup
    answers for none of the blocks that went with it, they are reported removed,
    and the tier makes its directory again and stores into it."""
    tier = rig.tier()
    gone: list[OffloadKey] = []
    tier.set_removal_listener(gone.extend)
    await tier.open()
    keys = rig.keys(4)
    assert (await rig.store(tier, keys))[0].ok
    shutil.rmtree(tier.directory if removed == "namespace" else rig.path)
    assert await tier.lookup(keys, CTX) == [False] * 4
    assert sorted(gone) == sorted(keys) and len(tier) == 0 and tier.used_bytes == 0
    assert tier.directory.is_dir()
    stored, data = await rig.store(tier, keys[:2], first_slot=4)
    assert stored.ok, stored.error
    result, got = await rig.load(tier, keys[:2])
    assert result.ok and got == data
    assert await tier.lookup(keys, CTX) == [True, True, False, False]
    await tier.close()
    reopened = rig.tier()  # the new directory is a tier's like any other
    await reopened.open()
    assert len(reopened) == 2
    await reopened.close()


async def test_a_directory_that_cannot_be_made_again_reports_the_tier_down_until_it_can(
    rig,
) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(2)
    assert (await rig.store(tier, keys))[0].ok
    shutil.rmtree(rig.path)
    rig.path.write_text("not a directory")  # the path is taken by a file now
    with pytest.raises(TierUnavailable, match="vanished and cannot be made again"):
        await tier.lookup(keys, CTX)
    with pytest.raises(TierUnavailable):
        await tier.store(rig.job(keys, [0, 1]))
    rig.path.unlink()
    assert await tier.lookup(keys, CTX) == [False, False]  # made anew: serving, empty
    assert (await rig.store(tier, keys))[0].ok
    await tier.close()


async def test_a_store_in_flight_when_the_directory_is_made_anew_is_not_counted(rig) -> None:
    """A write that lands in the old directory while a lookup found it gone and made
    a new one: its block is not in the new directory, so it is not indexed."""
    import threading

    import anyio

    tier = rig.tier()
    await tier.open()
    [late] = rig.keys(1)
    real = tier._write_chunk  # a block thread's call or the core's queue's
    removed, retaken = threading.Event(), threading.Event()

    async def write_meanwhile(*args: Any) -> Any:
        outcomes = await real(*args)  # into the old directory
        shutil.rmtree(tier.directory)
        removed.set()
        # the lookup below takes the directory again meanwhile (the wait shielded, as
        # the write is)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(retaken.wait, 10)
        return outcomes

    tier._write_chunk = write_meanwhile  # type: ignore[method-assign]
    results: list[Any] = []

    async def store() -> None:
        results.append((await rig.store(tier, [late]))[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(store)
        await anyio.to_thread.run_sync(removed.wait, 10)
        assert await tier.lookup([late], CTX) == [False]
        retaken.set()
    tier._write_chunk = real  # type: ignore[method-assign]
    assert results[0].failed_keys == (late,)
    assert await tier.lookup([late], CTX) == [False]
    assert len(tier) == 0 and tier.used_bytes == 0
    await tier.close()
