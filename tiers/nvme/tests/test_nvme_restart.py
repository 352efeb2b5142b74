"""A restart finds every whole block and nothing else: the index is rebuilt from the
directory, crash leftovers and damaged files are deleted, capacity is enforced."""

from __future__ import annotations

import os
import time

import pytest

from tierkv.contract.framing import encode_block
from tierkv.contract.jobs import ReqContext

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-restart")


async def test_a_new_tier_on_the_same_path_finds_every_block(rig) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(10)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    await tier.close()

    reopened = rig.tier()
    await reopened.open()
    assert reopened.recovery is not None
    assert reopened.recovery.blocks == 10
    assert reopened.recovery.removed_temp == reopened.recovery.removed_bad == 0
    assert reopened.used_bytes == 10 * rig.footprint()
    assert await reopened.lookup(keys, CTX) == [True] * 10
    result, loaded = await rig.load(reopened, keys)
    assert result.ok, result.error
    assert loaded == stored
    await reopened.close()


async def test_reopen_drops_truncated_and_temporary_files_and_fails_a_flipped_byte(rig) -> None:
    tier = rig.tier()
    await tier.open()
    truncated, flipped, *good = keys = rig.keys(5)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    await tier.close()

    # a crash mid-write without temp+rename would leave this: half a frame
    path = tier.path_of(truncated)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # a crash between create and rename leaves this
    temp = tier.path_of(good[0]).with_name(".interrupted.123-0.tmp")
    temp.write_bytes(b"partial")
    # bit rot in the payload: the header is fine, only the checksum can tell
    with open(tier.path_of(flipped), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte ^ 0x01]))

    reopened = rig.tier()
    await reopened.open()
    assert not path.exists()
    assert not temp.exists()
    assert reopened.recovery is not None
    assert (reopened.recovery.removed_bad, reopened.recovery.removed_temp) == (1, 1)
    assert await reopened.lookup(keys, CTX) == [False, True, True, True, True]

    result, loaded = await rig.load(reopened, [flipped, *good])
    assert result.failed_keys == (flipped,)
    assert "corrupt block deleted: payload checksum mismatch" in (result.error or "")
    assert not tier.path_of(flipped).exists()
    assert await reopened.lookup([flipped], CTX) == [False]
    assert all(loaded[k] == stored[k] for k in good)
    assert reopened.used_bytes == 3 * rig.footprint()
    await reopened.close()


async def test_reopen_deletes_files_that_are_not_this_tiers_blocks_and_keeps_the_rest(
    rig,
) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(8)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    await tier.close()
    block = rig.block_bytes
    other_ns, misplaced, padded, garbage, wrong_size, kept = keys[:6]

    # a frame of another namespace (same key) in this namespace's directory
    tier.path_of(other_ns).write_bytes(encode_block(other_ns, stored[other_ns], "elsewhere"))
    # a whole, valid frame of one key under another key's name
    tier.path_of(misplaced).write_bytes(tier.path_of(kept).read_bytes())
    # trailing bytes after the payload
    with open(tier.path_of(padded), "ab") as f:
        f.write(b"\0")
    # not a tierkv frame at all
    tier.path_of(garbage).write_bytes(os.urandom(block + 100))
    # a well-formed frame for a different block size (the layout changed)
    tier.path_of(wrong_size).write_bytes(encode_block(wrong_size, b"x" * (block // 2), "nvme-test"))
    # something a person left there: not ours, not touched
    stranger = tier.directory / "ab" / "cd" / "notes.txt"
    stranger.parent.mkdir(parents=True, exist_ok=True)
    stranger.write_text("keep me")

    reopened = rig.tier()
    await reopened.open()
    assert reopened.recovery is not None
    assert reopened.recovery.removed_bad == 5
    assert await reopened.lookup(keys, CTX) == [False] * 5 + [True] * 3
    assert stranger.read_text() == "keep me"
    assert sorted(rig.files(reopened, ".blk")) == sorted(tier.path_of(k) for k in keys[5:])
    result, loaded = await rig.load(reopened, keys[5:])
    assert result.ok, result.error
    assert all(loaded[k] == stored[k] for k in keys[5:])
    await reopened.close()


async def test_reopen_with_less_capacity_keeps_the_most_recent_by_mtime(rig) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(6)
    assert (await rig.store(tier, keys))[0].ok
    await tier.close()
    # recency order on disk, unrelated to the order they were written in
    order = [keys[i] for i in (3, 0, 5, 1, 4, 2)]  # oldest first
    base = time.time_ns() - 10**12
    for age, key in enumerate(order):
        stamp = base + age * 10**9
        os.utime(tier.path_of(key), ns=(stamp, stamp))

    smaller = rig.tier(capacity_blocks=3)
    await smaller.open()
    assert smaller.recovery is not None
    assert smaller.recovery.evicted_over_capacity == 3
    assert await smaller.lookup(order, CTX) == [False] * 3 + [True] * 3
    assert [tier.path_of(k).exists() for k in order] == [False] * 3 + [True] * 3
    assert smaller.used_bytes == 3 * rig.footprint()
    await smaller.close()


async def test_a_load_makes_a_block_recent_across_a_restart(rig) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(3)
    a = keys[0]
    assert (await rig.store(tier, keys))[0].ok
    await tier.close()
    base = time.time_ns() - 10**12
    for age, key in enumerate(keys):  # a oldest, c newest
        os.utime(tier.path_of(key), ns=(base + age * 10**9,) * 2)
    tier = rig.tier()  # the tier knows its files' mtimes from its index (no fstat per
    await tier.open()  # read): it learns these old ones when it reopens
    assert (await rig.load(tier, [a]))[0].ok  # a becomes the newest, on disk too
    await tier.close()

    smaller = rig.tier(capacity_blocks=2)
    await smaller.open()
    assert await smaller.lookup(keys, CTX) == [True, False, True]
    await smaller.close()


async def test_the_cycle_collector_waits_while_an_open_rebuilds_its_index(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rebuild builds objects by the block; the cycle collector is paused while it
    does (`recovery.cycles_uncollected`) and runs again once the open has its index."""
    import gc

    tier = rig.tier()
    await tier.open()
    await rig.store(tier, rig.keys(5))
    await tier.close()
    reopened = rig.tier()
    seen: list[bool] = []
    rebuild = type(reopened)._rebuild

    def watched(self, scan) -> None:
        seen.append(gc.isenabled())
        rebuild(self, scan)

    monkeypatch.setattr(type(reopened), "_rebuild", watched)
    assert gc.isenabled()
    await reopened.open()
    assert seen == [False]
    assert gc.isenabled()
    assert reopened.recovery is not None and reopened.recovery.blocks == 5
    await reopened.close()


def test_pauses_of_the_cycle_collector_are_counted_and_restore_what_was_there() -> None:
    """Holders overlap (stripes open side by side, scans in threads): the collector runs
    again only when the last leaves, and only if it ran when the first came."""
    import gc
    import threading

    from tierkv_nvme.recovery import cycles_uncollected

    assert gc.isenabled()
    first, second = cycles_uncollected(), cycles_uncollected()
    first.__enter__()
    done = threading.Event()

    def other() -> None:
        with cycles_uncollected():
            assert not gc.isenabled()
        done.set()

    second.__enter__()
    first.__exit__(None, None, None)  # the first leaves before the second
    assert not gc.isenabled()
    threading.Thread(target=other).start()
    assert done.wait(10)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()  # a process that runs without it keeps it off
    try:
        with cycles_uncollected():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
