"""`layout: slab`: the slot format, the rebuild, slot reuse, crash safety.

The contract itself (round trips, capacity, corruption, MAC frames) is the conformance
suite's (`test_nvme_slab_conformance.py`); these are what slots add: both engines
write the same bytes, a restart finds the newest copy of each key in its write order,
torn and removed slots stay misses, a slot is never rewritten under a reader, a shrunk
capacity or a slab of another block size is dealt with at open, and a writer killed
mid-batch leaves only whole blocks."""

from __future__ import annotations

import hashlib
import inspect
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierkv_nvme import NvmeTier, NvmeTierConfig, slabfile
from tierkv_nvme.slab import SlabNvmeTier

from tierkv.contract.framing import Framer
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.mac import MacKey
from tierkv.contract.slab import PrimaryView
from tierkv.testing import random_keys

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-slab")
Rig = Any  # the conftest's Rig (the `rig` and `make_rig` fixtures)


def slab_bytes(tier: SlabNvmeTier) -> list[bytes]:
    return [path.read_bytes() for path in tier.slab_paths]


def slab_sizes(tier: SlabNvmeTier) -> list[int]:
    return [path.stat().st_size for path in tier.slab_paths]


def sized(slots: int, block_bytes: int) -> list[int]:
    """What the slab files' sizes must be with `slots` slots."""
    room = slabfile.room_for(block_bytes)
    return [slabfile.file_bytes(slots, i, room) for i in range(slabfile.SLAB_FILES)]


def poke(tier: SlabNvmeTier, place: int, at: int, data: bytes) -> None:
    """Write `data` at byte `at` of slot `place` (0: its payload's first byte)."""
    index, offset = slabfile.locate(place, slabfile.room_for(tier.primary.block_bytes))
    fd = os.open(tier.slab_paths[index], os.O_RDWR)
    try:
        os.pwrite(fd, data, offset + at)
    finally:
        os.close(fd)


def slab_tier(rig: Rig, slots: int = 64, **fields: Any) -> SlabNvmeTier:
    tier = rig.tier(capacity=slots * slabfile.slot_bytes(rig.block_bytes), layout="slab", **fields)
    assert isinstance(tier, SlabNvmeTier)
    return tier


# -- the format ------------------------------------------------------------------------


def test_a_header_page_seals_and_unseals_and_any_flipped_bit_fails_it() -> None:
    head = Framer("ns").encode_header(b"k" * 20, b"x" * 100)
    page = slabfile.seal(head, 7)
    assert len(page) == slabfile.PAGE
    assert slabfile.unseal(page) == (7, head)
    rng = random.Random(1)
    for _ in range(64):
        bit = rng.randrange((slabfile.SLOT_HEAD_BYTES + len(head)) * 8)
        torn = bytearray(page)
        torn[bit // 8] ^= 1 << (bit % 8)
        assert slabfile.unseal(torn) is None, bit
    assert slabfile.unseal(bytes(slabfile.PAGE)) is None


def test_a_key_too_long_for_a_slot_header_is_refused_naming_the_files_layout() -> None:
    head = Framer("ns").encode_header(b"k" * 5000, b"x")
    with pytest.raises(ValueError, match="layout: files"):
        slabfile.seal(head, 1)


@pytest.mark.parametrize("block_bytes", [1000, 4096, 5000, 16 << 10])
async def test_both_engines_write_the_same_slab_bytes(
    tmp_path: Path, block_bytes: int, make_rig: Any, native_core: None
) -> None:
    """The same blocks stored by the Python path and by the compiled core give slab
    files equal byte for byte, and each engine reads the other's."""
    keys = random_keys(12, random.Random(block_bytes))
    payloads = [random.Random(k).randbytes(block_bytes) for k in keys]
    files = {}
    for engine in ("python", "native"):
        rig = make_rig(tmp_path / engine, block_bytes=block_bytes, io_engine=engine)
        for slot, payload in enumerate(payloads):
            rig.view.block(slot)[:] = payload
        tier = slab_tier(rig, slots=16)
        await tier.open()
        result = await tier.store(rig.job(keys, range(len(keys))))
        assert result.ok, result.error
        assert tier.describe()["batch_calls"] == (engine == "native")
        await tier.close()
        files[engine] = slab_bytes(tier)
    assert files["python"] == files["native"]
    for engine, other in (("python", "native"), ("native", "python")):
        rig = make_rig(tmp_path / other, block_bytes=block_bytes, io_engine=engine)
        tier = slab_tier(rig, slots=16)
        await tier.open()
        result, got = await rig.load(tier, keys, first_slot=16)
        assert result.ok, result.error
        assert [got[k] for k in keys] == payloads
        await tier.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    block_bytes=st.integers(1, 9000),
    key_bytes=st.integers(1, 100),
    seq=st.integers(1, 2**64 - 1),
)
def test_python_and_core_slots_are_identical_for_any_block_key_and_seq(
    tmp_path_factory: pytest.TempPathFactory,
    native_core: None,
    block_bytes: int,
    key_bytes: int,
    seq: int,
) -> None:
    """Property: one slot written by `slabfile.write_slot` and by the core's
    `slab_write` is the same bytes, for any block size, key length and sequence."""
    from tierkv_nvme import native

    where = tmp_path_factory.mktemp("slot")
    framer = Framer("prop")
    rng = random.Random(block_bytes * 131 + key_bytes)
    key = rng.randbytes(key_bytes)
    view = PrimaryView(bytearray(rng.randbytes(2 * block_bytes)), block_bytes, "prop")
    room = slabfile.room_for(block_bytes)
    place = slabfile.SLAB_FILES + 1  # file 1, its second slot
    made = []
    for name in ("py", "c"):
        paths = [where / f"{name}{i}" for i in range(slabfile.SLAB_FILES)]
        fds = tuple(os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths)
        try:
            if name == "py":
                slabfile.write_slot(fds, place, room, key, view.block(1), framer, seq)
            else:
                codes = native.slab_write(
                    fds, [key], [1], view, view.lanes or (), framer,
                    place.to_bytes(8, "little"), seq.to_bytes(8, "little"), room, 64,
                    fsync=False,
                )  # fmt: skip
                assert codes == [None]
        finally:
            for fd in fds:
                os.close(fd)
        made.append([p.read_bytes() for p in paths])
    assert made[0] == made[1] and made[0][1] and not made[0][0]


# -- the rebuild -------------------------------------------------------------------------


async def test_a_reopened_slab_serves_every_block_in_write_order(rig: Rig) -> None:
    tier = slab_tier(rig)
    await tier.open()
    keys = rig.keys(10)
    _result, stored = await rig.store(tier, keys)
    await tier.close()
    again = slab_tier(rig)
    await again.open()
    assert again.recovery is not None and again.recovery.blocks == 10
    assert list(again._index) == keys  # the LRU order: oldest sequence first
    result, got = await rig.load(again, keys)
    assert result.ok and got == stored
    await again.close()


async def test_the_newest_copy_of_a_key_wins_and_the_older_slot_is_free(rig: Rig) -> None:
    tier = slab_tier(rig, slots=8)
    await tier.open()
    [key] = rig.keys(1)
    await rig.store(tier, [key])
    first = tier._index[key].place
    await tier.close()
    newer = rig.rng.randbytes(rig.block_bytes)  # as a crash between a rewrite and a free
    fds = [os.open(p, os.O_RDWR) for p in tier.slab_paths]
    try:
        room = slabfile.room_for(rig.block_bytes)
        slabfile.write_slot(fds, 5, room, key, newer, tier.framer, 99)
    finally:
        for fd in fds:
            os.close(fd)
    again = slab_tier(rig, slots=8)
    await again.open()
    assert again._index[key].place == 5 and first != 5
    assert first in again._free and 5 not in again._free
    result, got = await rig.load(again, [key])
    assert result.ok and got[key] == newer
    await again.close()


async def test_a_torn_header_is_a_miss_and_a_torn_payload_fails_its_load(rig: Rig) -> None:
    tier = slab_tier(rig)
    await tier.open()
    keys = rig.keys(3)
    _result, stored = await rig.store(tier, keys)
    room = slabfile.room_for(rig.block_bytes)
    places = [tier._index[k].place for k in keys]
    await tier.close()
    poke(tier, places[0], room + 40, b"\xff")  # key 0: a byte of its header page
    poke(tier, places[1], 17, b"\xff\xfe")  # key 1: bytes of its payload
    again = slab_tier(rig)
    await again.open()
    assert await again.lookup(keys, CTX) == [False, True, True]
    result, got = await rig.load(again, keys[1:])
    assert result.failed_keys == (keys[1],) and "checksum" in (result.error or "")
    assert got[keys[2]] == stored[keys[2]]
    assert await again.lookup(keys, CTX) == [False, False, True]
    await again.close()


def punches(directory: Path) -> bool:
    """Whether the filesystem under `directory` gives a punched hole's blocks back."""
    probe = directory / "punch-probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, bytes(8192), 0)
        os.fsync(fd)
        before = os.fstat(fd).st_blocks
        slabfile.release([fd] * slabfile.SLAB_FILES, [0], 4096)  # slot 0: bytes 4096-12287
        return os.fstat(fd).st_blocks < before
    finally:
        os.close(fd)
        probe.unlink()


def disk_bytes(tier: SlabNvmeTier) -> int:
    return sum(path.stat().st_blocks * 512 for path in tier.slab_paths)


async def test_removed_blocks_stay_gone_after_a_restart_and_give_their_disk_back(
    rig: Rig,
) -> None:
    tier = slab_tier(rig)
    await tier.open()
    keys = rig.keys(4)
    await rig.store(tier, keys)
    full = disk_bytes(tier)
    await tier.remove(keys[:2])
    slot = slabfile.slot_bytes(rig.block_bytes)
    if punches(tier.directory):  # tmpfs, ext4, xfs, btrfs; else the slots stay allocated
        assert disk_bytes(tier) == full - 2 * slot
    await tier.close()
    again = slab_tier(rig)
    await again.open()
    assert await again.lookup(keys, CTX) == [False, False, True, True]
    await again.close()


async def test_a_shrunk_capacity_evicts_the_slots_past_the_new_end(rig: Rig) -> None:
    tier = slab_tier(rig, slots=16)
    await tier.open()
    keys = rig.keys(16)
    _result, stored = await rig.store(tier, keys)
    places = {k: tier._index[k].place for k in keys}
    await tier.close()
    small = slab_tier(rig, slots=6)
    await small.open()
    assert small.recovery is not None
    kept = [k for k in keys if places[k] < 6]
    assert sorted(small._index) == sorted(kept) and len(kept) == 6
    assert small.recovery.evicted_over_capacity == 10
    assert slab_sizes(small) == sized(6, 4096)
    result, got = await rig.load(small, kept)
    assert result.ok and all(got[k] == stored[k] for k in kept)
    await small.close()


async def test_a_slab_of_another_block_size_is_started_anew(tmp_path: Path, make_rig: Any) -> None:
    rig = make_rig(tmp_path / "nvme", block_bytes=4096)
    tier = slab_tier(rig)
    await tier.open()
    await rig.store(tier, rig.keys(4))
    await tier.close()
    other = make_rig(tmp_path / "nvme", block_bytes=8192)  # same namespace, new geometry
    again = slab_tier(other)
    await again.open()
    assert len(again) == 0
    keys = other.keys(2)
    _result, stored = await other.store(again, keys)
    result, got = await other.load(again, keys)
    assert result.ok and got == stored
    await again.close()


# -- slots and readers -------------------------------------------------------------------


async def test_a_slot_removed_under_a_reader_is_reused_only_after_the_read(rig: Rig) -> None:
    tier = slab_tier(rig, slots=4)
    await tier.open()
    [key] = rig.keys(1)
    await rig.store(tier, [key])
    place = tier._index[key].place
    tier._pins[key] = 1  # a load of it in flight
    await tier.remove([key])
    assert place not in tier._free
    assert tier.room().free_blocks == 3  # the held-back slot is not offered
    others = rig.keys(3)
    result, _ = await rig.store(tier, others)
    assert result.ok and place not in {tier._index[k].place for k in others}
    tier._unpin([key])
    assert tier._free == [place] and tier.room().free_blocks == 1
    await tier.close()


async def test_a_full_slab_rewrites_the_slots_its_evictions_free(rig: Rig) -> None:
    tier = slab_tier(rig, slots=8)
    await tier.open()
    first = rig.keys(8)
    await rig.store(tier, first)
    places = {tier._index[k].place for k in first}
    second = rig.keys(8)
    result, stored = await rig.store(tier, second)
    assert result.ok
    assert {tier._index[k].place for k in second} == places
    assert tier.used_bytes == 8 * slabfile.slot_bytes(rig.block_bytes)
    assert slab_sizes(tier) == sized(8, 4096)
    loaded, got = await rig.load(tier, second)
    assert loaded.ok and got == stored
    await tier.close()


async def test_evicted_slots_are_rewritten_in_place_and_the_unused_punched_out(
    rig: Rig,
) -> None:
    """`evict` (a shared budget making room for this tier's store) leaves the slots
    allocated for the next store to rewrite; what that store does not take is
    punched out when it ends, so the disk holds what the blocks take."""
    tier = slab_tier(rig, slots=8)
    await tier.open()
    first = rig.keys(8)
    await rig.store(tier, first)
    full = disk_bytes(tier)
    places = {k: tier._index[k].place for k in first}
    await tier.evict(first[:3])
    assert await tier.lookup(first, CTX) == [False] * 3 + [True] * 5
    assert tier.used_bytes == 5 * slabfile.slot_bytes(rig.block_bytes)
    assert disk_bytes(tier) == full  # not punched: kept for the next store
    [new] = rig.keys(1)
    result, stored = await rig.store(tier, [new])
    assert result.ok
    assert tier._index[new].place in {places[k] for k in first[:3]}  # rewritten in place
    slot = slabfile.slot_bytes(rig.block_bytes)
    if punches(tier.directory):  # the two the store left are punched out
        assert disk_bytes(tier) == full - 2 * slot
    assert not tier._reusable
    assert tier.room().free_blocks == 2  # back in the free list once punched
    loaded, got = await rig.load(tier, [new, *first[3:]], first_slot=8)
    assert loaded.ok and got[new] == stored[new]
    more = rig.keys(2)
    result, _ = await rig.store(tier, more)
    assert result.ok and len(tier) == 8
    await tier.close()


async def test_a_stale_load_refreshes_the_recency_a_restart_sees(rig: Rig) -> None:
    tier = slab_tier(rig)
    await tier.open()
    keys = rig.keys(3)
    await rig.store(tier, keys)
    tier._index[keys[0]].touched_ns = 0  # stale: this load rewrites its sequence
    fresh = tier._index[keys[1]].touched_ns  # not: its sequence stays
    result, _ = await rig.load(tier, keys[:2])
    assert result.ok
    assert tier._index[keys[0]].touched_ns > 0  # refreshed: the next load leaves it
    assert tier._index[keys[1]].touched_ns == fresh
    await tier.close()
    again = slab_tier(rig)
    await again.open()
    assert list(again._index) == [keys[1], keys[2], keys[0]]
    await again.close()


async def test_a_vanished_directory_is_made_anew_with_an_empty_slab(rig: Rig) -> None:
    import shutil

    tier = slab_tier(rig, slots=8)
    await tier.open()
    keys = rig.keys(4)
    await rig.store(tier, keys)
    shutil.rmtree(tier.directory)
    assert await tier.lookup(keys, CTX) == [False] * 4
    assert len(tier._free) == 8
    more = rig.keys(8)
    result, stored = await rig.store(tier, more)
    assert result.ok, result.error
    loaded, got = await rig.load(tier, more)
    assert loaded.ok and got == stored
    await tier.close()


async def test_a_long_key_fails_its_store_and_the_rest_are_stored(rig: Rig) -> None:
    tier = slab_tier(rig)
    await tier.open()
    keys = [rig.keys(1)[0], b"L" * 5000, rig.keys(1)[0]]
    result, stored = await rig.store(tier, keys)
    assert result.failed_keys == (keys[1],)
    assert "layout: files" in (result.error or "")
    assert len(tier._free) == 62  # the refused key's slot went back
    loaded, got = await rig.load(tier, [keys[0], keys[2]])
    assert loaded.ok and got[keys[0]] == stored[keys[0]]
    await tier.close()


async def test_slab_stripes_each_keep_their_own_slab(tmp_path: Path, rig: Rig) -> None:
    config = NvmeTierConfig(
        type="nvme",
        paths=[tmp_path / "a", tmp_path / "b"],
        capacity=32 * slabfile.slot_bytes(4096),
        layout="slab",
        io_engine=rig.io_engine,
    )
    tier = NvmeTier(config, rig.view)
    await tier.open()
    keys = rig.keys(12)
    _result, stored = await rig.store(tier, keys)  # type: ignore[arg-type]
    result, got = await rig.load(tier, keys)  # type: ignore[arg-type]
    assert result.ok and got == stored
    for drive in (tmp_path / "a", tmp_path / "b"):
        assert len(list(drive.rglob("*.kvslab"))) == slabfile.SLAB_FILES
    await tier.close()


# -- a writer killed mid-batch -----------------------------------------------------------

KILL_BLOCK = 16 << 10
KILL_JOB = 64
KILL_SLOTS = 200


def kill_key(i: int) -> bytes:
    """Key `i` of the writer: a hash, then `i` (so the checker knows the writer made it)."""
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=12).digest() + i.to_bytes(8, "big")


def kill_payload(key: bytes) -> bytes:
    return random.Random(key).randbytes(KILL_BLOCK)


SLAB_WRITER = """
import sys
from pathlib import Path

import anyio
from tierkv_nvme import NvmeTier, NvmeTierConfig, slabfile

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.slab import PrimaryView


async def main(path: str, first: int) -> None:
    view = PrimaryView(bytearray(KILL_JOB * KILL_BLOCK), KILL_BLOCK, "slab-kill")
    config = NvmeTierConfig(
        type="nvme", path=Path(path), layout="slab", io_engine="native", fsync="never",
        capacity=KILL_SLOTS * slabfile.slot_bytes(KILL_BLOCK),
    )
    tier = NvmeTier(config, view)
    await tier.open()
    i, job = first, 0
    while True:  # until killed
        keys = [kill_key(j) for j in range(i, i + KILL_JOB)]
        for slot, key in enumerate(keys):
            view.block(slot)[:] = kill_payload(key)
        job += 1
        result = await tier.store(JobMetadata(job, tuple(keys), tuple(range(KILL_JOB))))
        if not result.ok:
            sys.exit(f"store failed: {result.error}")
        if job == 1:
            print("started", flush=True)
        i += KILL_JOB


anyio.run(main, sys.argv[1], int(sys.argv[2]))
"""


def slab_writer_source() -> str:
    """The writer script: the same key and payload functions as the checker's."""
    functions = "\n\n".join(inspect.getsource(f) for f in (kill_key, kill_payload))
    head = (
        "import hashlib\nimport random\n\n"
        f"KILL_BLOCK, KILL_JOB, KILL_SLOTS = {KILL_BLOCK}, {KILL_JOB}, {KILL_SLOTS}\n\n"
    )
    return head + functions + SLAB_WRITER


async def test_a_slab_writer_killed_mid_batch_leaves_only_whole_blocks(
    tmp_path: Path, native_core: None, killed_writer: Any
) -> None:
    """A writer process storing 16 KiB blocks in jobs of 64 into a slab of 200 slots
    (native, fsync never, eviction rewriting slots) is SIGKILLed at a random moment,
    three times on the same directory. Each time the reopened tier holds only the
    writer's blocks, each loads byte-identical to what was stored under its key or
    fails its checksum (a slot torn by the kill: a miss, never wrong bytes), it uses
    no more than its slots, and the file is exactly its slots' size."""
    path = tmp_path / "nvme"
    rng = random.Random()
    view = PrimaryView(bytearray(KILL_JOB * KILL_BLOCK), KILL_BLOCK, "slab-kill")
    job_ids = iter(range(1, 10**6))
    for round_, (low, high) in enumerate(((0.0, 0.1), (0.1, 0.3), (0.3, 0.6))):
        args = [str(path), str(round_ * 10**7)]
        killed_writer(slab_writer_source(), args, rng.uniform(low, high), tmp_path / "log")
        config = NvmeTierConfig(
            type="nvme", path=path, layout="slab", io_engine="native", fsync="never",
            capacity=KILL_SLOTS * slabfile.slot_bytes(KILL_BLOCK),
        )  # fmt: skip
        tier = NvmeTier(config, view)
        assert isinstance(tier, SlabNvmeTier)
        await tier.open()
        try:
            held = list(tier._index)
            assert held, "the writer's first job was stored whole before the kill"
            assert len(held) <= KILL_SLOTS
            assert slab_sizes(tier) == sized(KILL_SLOTS, KILL_BLOCK)
            for key in held:
                assert key == kill_key(int.from_bytes(key[12:], "big")), key.hex()
            for first in range(0, len(held), KILL_JOB):
                keys = held[first : first + KILL_JOB]
                slots = tuple(range(len(keys)))
                for slot in slots:
                    view.block(slot)[:] = bytes(KILL_BLOCK)
                result = await tier.load(JobMetadata(next(job_ids), tuple(keys), slots))
                assert len(result.failed_keys) <= 2 * 2, result.error  # torn: 2 threads
                for key, slot in zip(keys, slots):
                    if key not in result.failed_keys:
                        assert bytes(view.block(slot)) == kill_payload(key), key.hex()
        finally:
            await tier.close()


# -- from the file layout ----------------------------------------------------------------


async def test_a_directory_of_block_files_keeps_its_blocks_as_slots(rig: Rig) -> None:
    """A tier switched from `layout: files` to `layout: slab` on the same directory
    moves each block file into a slot (newest first while slots last, in their mtime
    order), deletes the files, and serves every block it kept."""
    files = rig.tier(capacity=64 * rig.footprint(), layout="files")
    await files.open()
    keys = rig.keys(12)
    _result, stored = await rig.store(files, keys)
    await files.close()
    for age, key in enumerate(reversed(keys)):  # stored in key order, a second apart
        os.utime(files.path_of(key), (time.time() - age, time.time() - age))
    slab = slab_tier(rig, slots=8)
    await slab.open()
    assert slab.recovery is not None and slab.recovery.converted == 8
    assert not rig.files(files, ".blk")
    assert list(slab._index) == keys[4:]  # the 8 newest, oldest first
    result, got = await rig.load(slab, keys[4:])
    assert result.ok and all(got[k] == stored[k] for k in keys[4:])
    await slab.close()
    again = slab_tier(rig, slots=8)
    await again.open()
    assert again.recovery is not None and again.recovery.converted == 0 and len(again) == 8
    await again.close()


async def test_slab_files_are_private_whatever_the_umask(rig: Rig) -> None:
    """Slab files hold prompts' KV as block files do: 0600, in 0700 directories, under
    umask 0000 too."""
    old = os.umask(0)
    try:
        tier = slab_tier(rig)
        await tier.open()
        await rig.store(tier, rig.keys(3))
        await tier.close()
    finally:
        os.umask(old)
    for path in tier.slab_paths:
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert tier.directory.stat().st_mode & 0o777 == 0o700


class LentView(PrimaryView):
    """A primary whose slots have no one geometry (as LMCache's lent objects): the core
    takes each block's buffers one by one (`slab_write_items`, `slab_read_items`)."""

    @property
    def lanes(self) -> None:  # type: ignore[override]
        return None


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
async def test_blocks_lent_one_by_one_go_through_the_core_with_the_same_bytes(
    tmp_path: Path, native_core: None, signed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERKV_LENT_TEST_MAC", "m" * 32)
    block = 5000
    keys = random_keys(9, random.Random(3))
    made = {}
    for engine in ("python", "native"):
        view = LentView(bytearray(32 * block), block, "lent")
        for slot, key in enumerate(keys):
            view.block(slot)[:] = random.Random(key).randbytes(block)
        config = NvmeTierConfig(
            type="nvme", path=tmp_path / engine, capacity=16 * slabfile.slot_bytes(block),
            layout="slab", io_engine=engine, fsync="always",
            mac_key_env="TIERKV_LENT_TEST_MAC" if signed else None,
        )  # fmt: skip
        tier = NvmeTier(config, view)
        assert isinstance(tier, SlabNvmeTier)
        await tier.open()
        assert not tier.describe()["batch_calls"]
        long_key = b"L" * 5000
        result = await tier.store(JobMetadata(1, (*keys, long_key), tuple(range(10))))
        assert result.failed_keys == (long_key,) and "layout: files" in (result.error or "")
        for slot in range(16, 25):
            view.block(slot)[:] = bytes(block)
        loaded = await tier.load(JobMetadata(2, tuple(keys), tuple(range(16, 25))))
        assert loaded.ok, loaded.error
        for i, key in enumerate(keys):
            assert bytes(view.block(16 + i)) == random.Random(key).randbytes(block)
        await tier.close()
        made[engine] = slab_bytes(tier)
    assert made["python"] == made["native"]


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
async def test_the_cores_scan_finds_what_the_python_scan_finds(
    tmp_path: Path, make_rig: Any, native_core: None, signed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one slab with written, never-written (holes), torn, removed, foreign-namespace
    and other-size slots (and for a signing tier, slots signed by another key and
    unsigned ones), `native.slab_scan` returns the same slots and bad count as
    `slabfile.scan`, file by file."""
    from tierkv_nvme import native

    rig = make_rig(tmp_path / "nvme", io_engine="native")
    fields: dict[str, Any] = {}
    if signed:
        monkeypatch.setenv("TIERKV_SCAN_TEST_MAC", os.urandom(32).hex())
        fields["mac_key_env"] = "TIERKV_SCAN_TEST_MAC"
    tier = slab_tier(rig, slots=200, **fields)
    await tier.open()
    keys = rig.keys(60)
    for first in range(0, 60, 20):
        await rig.store(tier, keys[first : first + 20])
    await tier.remove(keys[:5])
    places = [tier._index[k].place for k in keys[5:]]
    room = slabfile.room_for(rig.block_bytes)
    await tier.close()
    poke(tier, places[0], room + 40, b"\xff")  # a torn header: skipped, not bad
    fds = [os.open(p, os.O_RDWR) for p in tier.slab_paths]
    try:
        other = Framer("another namespace", tier.framer.mac_key)
        slabfile.write_slot(fds, 150, room, b"f" * 20, bytes(rig.block_bytes), other, 7)
        slabfile.write_slot(fds, 170, room, b"s" * 20, bytes(100), tier.framer, 8)  # size: bad
        if signed:  # another trust domain's, and unsigned: both bad
            theirs = Framer(tier.framer.namespace, MacKey(os.urandom(32)))
            slabfile.write_slot(fds, 190, room, b"g" * 20, bytes(rig.block_bytes), theirs, 9)
            plain = Framer(tier.framer.namespace)
            slabfile.write_slot(fds, 191, room, b"h" * 20, bytes(rig.block_bytes), plain, 10)
        for index, fd in enumerate(fds):
            python = slabfile.scan(fd, index, room, tier.framer, rig.block_bytes)
            core = native.slab_scan(fd, index, room, tier.framer, rig.block_bytes)
            assert core == python, index
            for scan in (slabfile.scan, native.slab_scan):  # reading ahead, as when cold
                cold = scan(fd, index, room, tier.framer, rig.block_bytes, cold=True)
                assert cold == python, (index, scan)
        every = [
            slabfile.scan(fd, i, room, tier.framer, rig.block_bytes) for i, fd in enumerate(fds)
        ]
    finally:
        for fd in fds:
            os.close(fd)
    found = {f.key for part, _bad in every for f in part}
    assert found == set(keys[6:])
    assert sum(bad for _part, bad in every) == (4 if signed else 2)


async def test_a_scan_that_fails_fails_the_open_naming_the_error(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slab file that cannot be read at open (EIO from one file's scan, while the
    others scan beside it) fails the open with TierUnavailable naming the error, as
    the tier's other open failures do, and leaves the directory free for a retry."""
    import errno

    from tierkv_nvme import native

    from tierkv.tier import TierUnavailable

    tier = slab_tier(rig)
    await tier.open()
    await rig.store(tier, rig.keys(10))
    await tier.close()
    scans = {"native": native.slab_scan, "python": slabfile.scan}

    def failing(name: str) -> Any:
        def scan(fd: int, index: int, *args: Any) -> Any:
            if index == 3:
                raise OSError(errno.EIO, "Input/output error")
            return scans[name](fd, index, *args)

        return scan

    monkeypatch.setattr(native, "slab_scan", failing("native"))
    monkeypatch.setattr(slabfile, "scan", failing("python"))
    broken = slab_tier(rig)
    with pytest.raises(TierUnavailable, match=r"cannot read its directory.*Input/output error"):
        await broken.open()
    monkeypatch.undo()
    again = slab_tier(rig)
    await again.open()  # the failed open let the directory go
    assert again.describe()["blocks"] == 10
    await again.close()


@pytest.mark.python_io
async def test_a_cold_scan_asks_for_the_header_pages_ahead_of_it(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python scan reads header pages as they come until COLD_READS in a row take
    COLD_READ_NS (from the disk; one slow read alone is not enough); from the next slot
    on, each read first asks the kernel for the next SCAN_AHEAD slots' header pages
    (WILLNEED), each page once, and finds the same blocks."""
    tier = slab_tier(rig, slots=8 * 300)
    await tier.open()
    keys = rig.keys(8 * 250)
    for first in range(0, len(keys), 30):
        await rig.store(tier, keys[first : first + 30])
    await tier.close()
    room = slabfile.room_for(rig.block_bytes)
    fd = os.open(tier.slab_paths[0], os.O_RDONLY)
    try:
        warm, _bad = slabfile.scan(fd, 0, room, tier.framer, rig.block_bytes)
        slots = len(warm)
        assert slots > 2 * slabfile.SCAN_AHEAD
        file_slots = (os.fstat(fd).st_size - slabfile.PAGE) // (room + slabfile.PAGE)
        heads = [slabfile.PAGE + s * (room + slabfile.PAGE) + room for s in range(file_slots)]
        slow = {3} | set(range(10, 10 + slabfile.COLD_READS))  # a hiccup; then the disk
        slow_read = max(slow)  # the last of COLD_READS slow reads in a row
        reads: list[int] = []
        advised: list[int] = []
        clock = [0]
        real_pread = os.pread

        def pread(fd: int, size: int, offset: int) -> bytes:
            slot = (offset - slabfile.PAGE - room) // (room + slabfile.PAGE)
            if len(reads) > slow_read:  # cold by now: asked for up to SCAN_AHEAD ahead
                last = min(slot + slabfile.SCAN_AHEAD, file_slots) - 1
                assert offset in advised and advised[-1] == heads[last], slot
            clock[0] += slabfile.COLD_READ_NS if len(reads) in slow else 1_000
            reads.append(offset)
            return real_pread(fd, size, offset)

        def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
            assert advice == os.POSIX_FADV_WILLNEED and length == slabfile.PAGE
            advised.append(offset)

        monkeypatch.setattr(slabfile.os, "pread", pread)
        monkeypatch.setattr(slabfile.os, "posix_fadvise", fadvise)
        monkeypatch.setattr(slabfile.time, "perf_counter_ns", lambda: clock[0])
        found, _bad = slabfile.scan(fd, 0, room, tier.framer, rig.block_bytes)
    finally:
        os.close(fd)
    assert found == warm
    # every header page after the slow read's, once, in order, up to SCAN_AHEAD past
    # the last read (the hole after the blocks, where the scan stops)
    assert advised == heads[slow_read + 1 : slow_read + 1 + len(advised)]
    assert slots < slow_read + 1 + len(advised) <= slots + 1 + slabfile.SCAN_AHEAD


async def test_a_filesystem_without_seek_data_is_scanned_slot_by_slot(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `lseek(SEEK_DATA)` is refused (EINVAL: some FUSE and network
    filesystems), the Python scan steps over a hole to the next slot, not past the
    rest of the file."""
    import errno

    tier = slab_tier(rig, slots=64)
    await tier.open()
    keys = rig.keys(20)
    await rig.store(tier, keys)
    await tier.remove(keys[:10])  # holes before the blocks left
    await tier.close()

    def no_seek_data(fd: int, pos: int, how: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(slabfile.os, "lseek", no_seek_data)
    room = slabfile.room_for(rig.block_bytes)
    found = set()
    for index, path in enumerate(tier.slab_paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            slots, _bad = slabfile.scan(fd, index, room, tier.framer, rig.block_bytes)
        finally:
            os.close(fd)
        found |= {slot.key for slot in slots}
    assert found == set(keys[10:])
