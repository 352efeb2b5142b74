"""Disk full, permission and read errors fail the keys they hit, with a message that
names the cause and the fix, leave no partial file, and the tier keeps serving.

The disk-full test runs twice: on a real 256 KiB tmpfs (we are root on the test
machines; where mounting is refused, that run injects ENOSPC the way a full disk
returns it, so it never skips) and with ENOSPC injected on the normal disk."""

from __future__ import annotations

import errno
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.framing import FIXED_HEADER_BYTES
from tierkv.jobs import ReqContext

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-faults")
BLOCK = 16384
TINY_DISK = 256 * 1024


def _mount_tmpfs(where: Path, size: int) -> bool:
    """Mount a tmpfs of `size` bytes at `where`; False when not permitted here."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tierkv-test", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode == 0


@pytest.fixture(params=["tiny-tmpfs", "injected-enospc"])
def full_disk(request: pytest.FixtureRequest, tmp_path: Path, rig, faults) -> Iterator[str]:
    """A disk with room for about TINY_DISK bytes under `rig.path`; yields how."""
    if request.param == "tiny-tmpfs" and _mount_tmpfs(rig.path, TINY_DISK):
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(rig.path)], check=False)
        return
    if request.param == "tiny-tmpfs":
        warnings.warn(
            "mounting a tmpfs is not permitted here: injecting ENOSPC instead", stacklevel=2
        )
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


async def test_a_read_error_fails_that_key_and_withdraws_the_tiers_claim(rig, faults) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(3)
    _, stored = await rig.store(tier, keys)
    with faults.fail_read(errno.EIO):
        result, _ = await rig.load(tier, keys[:1])
    assert result.failed_keys == (keys[0],)
    assert "nvme read failed: Input/output error (EIO)" in (result.error or "")
    # a key whose load failed is no longer claimed, so nobody re-promotes it forever
    assert await tier.lookup(keys, CTX) == [False, True, True]
    result, loaded = await rig.load(tier, keys[1:])
    assert result.ok, result.error
    assert all(loaded[k] == stored[k] for k in keys[1:])
    await tier.close()


async def test_a_read_error_leaves_no_file_the_index_does_not_count(rig, faults) -> None:
    """A load failing with an I/O error forgets the key; its file must go too, or it
    takes disk space `capacity` no longer counts until the next restart."""
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(3)
    await rig.store(tier, keys)
    with faults.fail_read(errno.EIO):
        result, _ = await rig.load(tier, keys[:2])
    assert set(result.failed_keys) == set(keys[:2])
    assert len(rig.files(tier)) == len(tier) == 1
    assert tier.used_bytes == rig.footprint()
    _, stored = await rig.store(tier, keys[:1])  # stored again: a fresh, whole block
    result, loaded = await rig.load(tier, keys[:1])
    assert result.ok, result.error
    assert loaded[keys[0]] == stored[keys[0]]
    await tier.close()
