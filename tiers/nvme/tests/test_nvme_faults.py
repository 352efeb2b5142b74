"""Disk full, permission and read errors fail the keys they hit, with a message that
names the cause and the fix, leave no partial file, and the tier keeps serving.

The disk-full test runs twice: on a real 256 KiB tmpfs (we are root on the test
machines; where mounting is refused, that run injects ENOSPC the way a full disk
returns it, so it never skips) and with ENOSPC injected on the normal disk."""

from __future__ import annotations

import contextlib
import errno
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.contract.framing import FIXED_HEADER_BYTES
from tierkv.contract.jobs import ReqContext
from tierkv.testing import DiskFaultUnavailable, tiny_disk

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-faults")
BLOCK = 16384
TINY_DISK = 256 * 1024


@pytest.fixture(params=["tiny-tmpfs", "injected-enospc"])
def full_disk(request: pytest.FixtureRequest, tmp_path: Path, rig, faults) -> Iterator[str]:
    """A disk with room for about TINY_DISK bytes under `rig.path`; yields how."""
    if request.param == "tiny-tmpfs":
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(tiny_disk(rig.path, TINY_DISK))
            except DiskFaultUnavailable:
                warnings.warn(
                    "mounting a tmpfs is not permitted here: injecting ENOSPC instead",
                    stacklevel=2,
                )
            else:
                yield "tmpfs"
                return
    with faults.disk_of(TINY_DISK):
        yield "injected"


async def test_a_full_disk_fails_the_keys_that_do_not_fit_and_nothing_else(
    rig,
    full_disk: str,
) -> None:
    rig.__init__(rig.path, block_bytes=BLOCK)  # 16 KiB blocks: 20 KiB of disk each
    tier = rig.tier(capacity="64MiB")  # the tier believes it has room; the disk has not
    await tier.open()
    first = rig.keys(6)
    result, stored = await rig.store(tier, first)
    assert result.ok, result.error

    more = rig.keys(10)
    result, more_data = await rig.store(tier, more, first_slot=6)
    assert result.failed_keys, f"the {full_disk} disk did not fill up"
    assert result.ok_keys, "some blocks still fitted and must have been stored"
    assert "No space left on device (ENOSPC)" in (result.error or "")
    assert "is full: free space or lower `capacity`" in (result.error or "")
    stored.update((k, more_data[k]) for k in result.ok_keys)

    # no partial file: every file on disk is a whole block the index knows about
    assert not list(tier.directory.rglob("*.tmp"))
    files = rig.files(tier)
    assert sorted(files) == sorted(tier.path_of(k) for k in stored)
    assert all(p.stat().st_size == FIXED_HEADER_BYTES + 20 + BLOCK for p in files)
    assert await tier.lookup(list(result.failed_keys), CTX) == [False] * len(result.failed_keys)

    # reads go on
    keys = list(stored)
    result_load, loaded = await rig.load(tier, keys[:8], first_slot=16)
    assert result_load.ok, result_load.error
    assert all(loaded[k] == stored[k] for k in keys[:8])

    # a full disk does not keep a restarted tier from opening and serving its blocks
    await tier.close()
    tier = rig.tier(capacity="64MiB")
    await tier.open()
    assert await tier.lookup(keys, CTX) == [True] * len(keys)
    result_load, loaded = await rig.load(tier, keys[-8:], first_slot=16)
    assert result_load.ok, result_load.error
    assert all(loaded[k] == stored[k] for k in keys[-8:])

    # and writes work again once there is room
    await tier.remove(keys[:4])
    retry = list(set(more) - set(stored))[:2]
    result, _ = await rig.store(tier, retry, first_slot=24)
    assert result.ok, result.error
    await tier.close()


async def test_permission_denied_fails_the_job_with_a_clear_error_and_reads_go_on(
    rig,
    faults,
) -> None:
    tier = rig.tier()
    await tier.open()
    old = rig.keys(3)
    _, stored = await rig.store(tier, old)
    new = rig.keys(4)
    with faults.fail_create(errno.EACCES):
        result, _ = await rig.store(tier, new, first_slot=4)
    assert faults.hits >= 4
    assert set(result.failed_keys) == set(new)
    assert result.error == (
        f"nvme write failed: Permission denied (EACCES); tierkv may not write files under "
        f"{rig.path}: check the directory's owner, mode and mount options"
    )
    assert len(rig.files(tier)) == 3
    result, loaded = await rig.load(tier, old)
    assert result.ok, result.error
    assert loaded == stored
    result, _ = await rig.store(tier, new, first_slot=4)  # permission back: works again
    assert result.ok, result.error
    await tier.close()


async def test_a_read_error_fails_that_key_and_keeps_the_block(rig, faults) -> None:
    """An OS error may pass (EIO on a busy device): the key fails this time, the block
    stays, and the next read returns it byte-identical. Nothing is reported removed."""
    tier = rig.tier()
    removed: list[tuple[bytes, ...]] = []
    tier.set_removal_listener(removed.append)
    await tier.open()
    keys = rig.keys(3)
    _, stored = await rig.store(tier, keys)
    with faults.fail_read(errno.EIO):
        result, _ = await rig.load(tier, keys[:1])
    assert result.failed_keys == (keys[0],)
    assert "nvme read failed: Input/output error (EIO)" in (result.error or "")
    assert "block kept: 1 of 3" in (result.error or "")
    assert await tier.lookup(keys, CTX) == [True, True, True]
    assert len(rig.files(tier)) == len(tier) == 3 and not removed
    result, loaded = await rig.load(tier, keys)  # the hiccup passed
    assert result.ok, result.error
    assert all(loaded[k] == stored[k] for k in keys)
    await tier.close()


async def test_a_block_that_keeps_failing_to_read_is_deleted_and_counted_out(rig, faults) -> None:
    """READ_ERRORS_BEFORE_DELETE failed reads in a row give the block up: its file goes
    with its claim (no disk space that `capacity` no longer counts), it is reported
    removed, and a success in between starts the count again."""
    from tierkv_nvme.tier import READ_ERRORS_BEFORE_DELETE

    tier = rig.tier()
    removed: list[tuple[bytes, ...]] = []
    tier.set_removal_listener(removed.append)
    await tier.open()
    keys = rig.keys(3)
    await rig.store(tier, keys)
    for _ in range(READ_ERRORS_BEFORE_DELETE - 1):
        with faults.fail_read(errno.EIO):
            await rig.load(tier, keys[:2])
    result, _ = await rig.load(tier, keys[1:2])  # key 1 reads once: its count restarts
    assert result.ok, result.error
    with faults.fail_read(errno.EIO):
        result, _ = await rig.load(tier, keys[:2])
    assert set(result.failed_keys) == set(keys[:2])
    assert "deleted after 3 failed reads" in (result.error or "")
    assert await tier.lookup(keys, CTX) == [False, True, True]
    assert removed == [(keys[0],)]
    assert len(rig.files(tier)) == len(tier) == 2
    assert tier.used_bytes == 2 * rig.footprint()
    _, stored = await rig.store(tier, keys[:1])  # stored again: a fresh, whole block
    result, loaded = await rig.load(tier, keys[:1])
    assert result.ok, result.error
    assert loaded[keys[0]] == stored[keys[0]]
    await tier.close()


async def test_a_link_in_place_of_a_block_file_is_not_followed_nor_deleted_at_once(
    rig, tmp_path: Path
) -> None:
    """ELOOP (a link where the block file should be) is an OS error like EIO: the key
    fails, nothing outside the tier is read, and the entry stays until it keeps
    failing."""
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(1)
    await rig.store(tier, keys)
    path = tier.path_of(keys[0])
    outside = tmp_path / "outside.blk"
    path.rename(outside)
    path.symlink_to(outside)
    result, _ = await rig.load(tier, keys)
    assert result.failed_keys == (keys[0],)
    assert "symlink" in (result.error or "") and "block kept" in (result.error or "")
    assert path.is_symlink() and outside.exists()
    assert await tier.lookup(keys, CTX) == [True]
    await tier.close()
