"""The one-level layout (`ns/ab/<key hex>.blk`) and the move of blocks that earlier tiers
wrote two levels deep (`ns/ab/cd/<key hex>.blk`) up a level by `open`."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from tierkv_nvme import NvmeTier
from tierkv_nvme.layout import block_relpath, legacy_relpath

from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-layout")


def test_the_legacy_path_adds_a_second_level_under_the_same_first_one() -> None:
    key = bytes.fromhex("abcdef") + b"\x01" * 17
    first, name = block_relpath(key)
    assert (first, name) == ("ab", key.hex() + ".blk")
    assert legacy_relpath(key) == ("ab", "cd", name)
    assert block_relpath(b"") == ("00", ".blk")  # a key shorter than a byte


async def test_a_new_tier_makes_one_level_of_at_most_256_directories(rig) -> None:
    tier = rig.tier()
    await tier.open()
    result, _ = await rig.store(tier, rig.keys(16))
    assert result.ok, result.error
    dirs = [p for p in tier.directory.rglob("*") if p.is_dir()]
    assert dirs and all(p.parent == tier.directory and len(p.name) == 2 for p in dirs)
    assert len(dirs) <= 16
    await tier.close()


async def stored_and_closed(
    rig, n: int
) -> tuple[NvmeTier, list[OffloadKey], dict[OffloadKey, bytes]]:
    """A tier that stored `n` blocks and closed: (the tier, its keys, their bytes)."""
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(n)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    await tier.close()
    return tier, keys, stored


def to_legacy(directory: Path, key: bytes) -> Path:
    """Move `key`'s block file where a two-level tier kept it; its new path."""
    first, second, name = legacy_relpath(key)
    legacy = directory / first / second / name
    legacy.parent.mkdir(exist_ok=True)
    (directory / first / name).rename(legacy)
    return legacy


async def test_open_moves_two_level_blocks_up_and_serves_them_byte_identical(rig) -> None:
    tier, keys, stored = await stored_and_closed(rig, 12)
    legacy = [to_legacy(tier.directory, k) for k in keys[:8]]  # a move cut halfway
    temp = legacy[0].with_name(".interrupted.123-0.tmp")
    temp.write_bytes(b"half a block")
    foreign = legacy[1].with_name("notes.txt")  # not the tier's: left alone
    foreign.write_text("mine")
    misplaced = legacy[2].parent.parent / "zz" / legacy[2].name  # not a fan-out name
    misplaced.parent.mkdir()
    shutil.copy(legacy[2], misplaced)
    other = "ff" if legacy[3].parent.name != "ff" else "fe"
    wrong = legacy[3].parent.parent / other / legacy[3].name  # a second level the key
    wrong.parent.mkdir(exist_ok=True)  # does not name: deleted, as a misplaced file is
    shutil.copy(legacy[3], wrong)

    reopened = rig.tier()
    await reopened.open()
    assert reopened.recovery is not None
    assert reopened.recovery.moved_up == 8
    assert reopened.recovery.blocks == 12
    assert reopened.recovery.removed_temp == 1
    assert reopened.recovery.removed_bad == 1
    assert await reopened.lookup(keys, CTX) == [True] * 12
    loaded_result, loaded = await rig.load(reopened, keys)
    assert loaded_result.ok, loaded_result.error
    assert loaded == stored
    assert rig.files(reopened, ".blk") == sorted(reopened.path_of(k) for k in keys)
    assert not temp.exists() and not wrong.exists()
    assert foreign.read_text() == "mine" and misplaced.exists()
    for path in legacy:  # emptied second levels are gone; the one holding notes stays
        assert path.parent.exists() == (path.parent == foreign.parent)
    await reopened.close()

    again = rig.tier()  # nothing left to move
    await again.open()
    assert again.recovery is not None
    assert (again.recovery.moved_up, again.recovery.blocks) == (0, 12)
    await again.close()


async def test_a_block_in_both_layouts_is_kept_once(rig) -> None:
    tier, keys, stored = await stored_and_closed(rig, 2)
    copy = tier.directory.joinpath(*legacy_relpath(keys[0]))
    copy.parent.mkdir()
    shutil.copy(tier.path_of(keys[0]), copy)

    reopened = rig.tier()
    await reopened.open()
    assert reopened.recovery is not None
    assert (reopened.recovery.blocks, reopened.recovery.moved_up) == (2, 0)
    assert reopened.recovery.removed_bad == 1
    assert reopened.used_bytes == 2 * rig.footprint()
    assert not copy.exists() and not copy.parent.exists()
    loaded_result, loaded = await rig.load(reopened, keys)
    assert loaded_result.ok, loaded_result.error
    assert loaded == stored
    await reopened.close()


async def test_a_two_level_block_that_cannot_move_is_left_for_the_next_open(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused rename (a read-only disk, say) neither deletes the block nor counts it:
    the tier serves without it, and the next open that may move it does."""
    tier, keys, stored = await stored_and_closed(rig, 3)
    stuck = to_legacy(tier.directory, keys[0])
    real_rename = os.rename

    def refuse(src: object, dst: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))

    monkeypatch.setattr(os, "rename", refuse)
    reopened = rig.tier()
    await reopened.open()
    assert reopened.recovery is not None
    assert (reopened.recovery.moved_up, reopened.recovery.blocks) == (0, 2)
    assert reopened.used_bytes == 2 * rig.footprint()
    assert await reopened.lookup(keys, CTX) == [False, True, True]
    assert stuck.exists()
    await reopened.close()

    monkeypatch.setattr(os, "rename", real_rename)
    again = rig.tier()
    await again.open()
    assert again.recovery is not None
    assert (again.recovery.moved_up, again.recovery.blocks) == (1, 3)
    loaded_result, loaded = await rig.load(again, keys)
    assert loaded_result.ok, loaded_result.error
    assert loaded == stored
    await again.close()
