"""What the nvme tier refuses: links out of its directory, and any header field (the
2-byte flags included) that is not exactly what it writes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from tierkv_nvme.layout import block_relpath
from tierkv_nvme.tier import READ_ERRORS_BEFORE_DELETE

from tierkv.contract.framing import FIXED_HEADER_BYTES
from tierkv.contract.jobs import ReqContext

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-safety")


async def test_a_fanout_directory_that_is_a_symlink_is_never_followed(rig, tmp_path: Path) -> None:
    """A fan-out directory replaced by a link to somewhere else: loads, deletes and
    stores of the keys under it fail (ELOOP), and nothing outside the tier's directory
    is read, deleted or written."""
    outside = tmp_path / "outside"
    outside.mkdir()
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    result, _ = await rig.store(tier, [key])
    assert result.ok, result.error
    first, name = block_relpath(key)
    (tier.directory / first).rename(outside / "moved")  # the block now lives outside...
    (tier.directory / first).symlink_to(outside / "moved", target_is_directory=True)
    target = outside / "moved" / name  # ...reachable only through the link
    before = target.read_bytes()

    for _ in range(READ_ERRORS_BEFORE_DELETE):  # kept until it keeps failing
        assert await tier.lookup([key], CTX) == [True]
        result, data = await rig.load(tier, [key])
        assert result.failed_keys == (key,)
        assert "symlink" in (result.error or "")
        assert data[key] == bytes(rig.block_bytes), "the load read through the link"
        assert target.read_bytes() == before, "the failed load deleted a file outside"
    assert await tier.lookup([key], CTX) == [False]

    result, _ = await rig.store(tier, [key], first_slot=2)
    assert result.failed_keys == (key,)
    assert "symlink" in (result.error or "")
    assert sorted(p.name for p in (outside / "moved").iterdir()) == [name]
    await tier.remove([key])
    assert target.exists()
    await tier.close()


async def test_unknown_header_flags_fail_the_key_and_the_file_goes(rig) -> None:
    tier = rig.tier()
    await tier.open()
    [key] = rig.keys(1)
    result, _ = await rig.store(tier, [key])
    assert result.ok, result.error
    path = tier.path_of(key)
    frame = bytearray(path.read_bytes())
    struct.pack_into("<H", frame, 6, 0x8000)  # flags: a bit no tierkv writes
    path.write_bytes(frame)
    result, _ = await rig.load(tier, [key])
    assert result.failed_keys == (key,)
    assert "unknown header flags 0x8000" in (result.error or "")
    assert not path.exists()
    assert await tier.lookup([key], CTX) == [False]
    await tier.close()


async def test_reopen_deletes_files_with_bad_flags(rig) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(2)
    result, _ = await rig.store(tier, keys)
    assert result.ok, result.error
    await tier.close()
    path = tier.path_of(keys[0])
    frame = bytearray(path.read_bytes())
    assert len(frame) > FIXED_HEADER_BYTES
    struct.pack_into("<H", frame, 6, 0x0002)
    path.write_bytes(frame)
    again = rig.tier()
    await again.open()
    assert again.recovery is not None and again.recovery.removed_bad == 1
    assert await again.lookup(keys, CTX) == [False, True]
    await again.close()


@pytest.mark.parametrize("change", ["one byte more", "one byte less", "empty"])
async def test_a_block_file_of_the_wrong_length_fails_the_key_and_goes(rig, change: str) -> None:
    """A file that grew or shrank after the tier wrote it (the read learns its length
    from one spare byte, not an `fstat`): the key fails, nothing of it is served, the
    file is deleted, and the other keys of the load arrive whole."""
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(3)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    path = tier.path_of(keys[1])
    frame = path.read_bytes()
    path.write_bytes(
        {"one byte more": frame + b"\0", "one byte less": frame[:-1], "empty": b""}[change]
    )
    result, got = await rig.load(tier, keys)
    assert result.failed_keys == (keys[1],)
    assert "longer than a frame" in (result.error or "") or "ended after" in (result.error or "")
    assert got[keys[0]] == data[keys[0]] and got[keys[2]] == data[keys[2]]
    assert not path.exists()
    assert await tier.lookup(keys, CTX) == [True, False, True]
    await tier.close()
