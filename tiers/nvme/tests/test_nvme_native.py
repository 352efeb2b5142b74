"""The compiled batch I/O core (`native.py`, `_batchio.c`) against the Python path
(`blockfile`): the same frames byte for byte, each path reading what the other wrote,
the same outcome per block (missing, link, wrong length, every corrupt header field,
a flipped payload bit), corrupt files deleted, crash safety and many blocks over
several threads; and the `io_engine` switch. The rest of the nvme tests run on both
engines through the conftest's `io_engine` fixture."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import stat
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, blockfile, native
from tierkv_nvme.blockfile import ReadItem, Slot

from tierkv.contract.framing import FIXED_HEADER_BYTES, Framer
from tierkv.contract.keys import OffloadKey
from tierkv.contract.mac import MacKey
from tierkv.contract.slab import StridedView
from tierkv.primary import PrimaryTier
from tierkv.tier import CorruptBlock, TierUnavailable

pytestmark = pytest.mark.anyio
Writer = Callable[..., list[Exception | None]]


@pytest.fixture(params=["checksum", "mac"])
async def tier(native_rig: Any, request: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An open tier (native engine) whose directory and framer the tests drive the
    two paths' functions with directly: frames with a checksum only, and signed
    (`mac_key_env`: the core makes and checks the MAC)."""
    fields: dict[str, Any] = {}
    if request.param == "mac":
        monkeypatch.setenv("TIERKV_NATIVE_TEST_MAC", os.urandom(32).hex())
        fields["mac_key_env"] = "TIERKV_NATIVE_TEST_MAC"
    tier = native_rig.tier(fsync="never", **fields)
    await tier.open()
    yield tier
    await tier.close()


def write_native(tier: NvmeTier, items: list[Any], **kw: Any) -> list[Exception | None]:
    kw.setdefault("fsync", False)
    with tier._dirs.leaves() as leaves:
        return native.write_blocks(leaves, items, tier.framer, **kw)


def write_python(tier: NvmeTier, items: list[Any], **kw: Any) -> list[Exception | None]:
    outcomes: list[Exception | None] = []
    with tier._dirs.leaves() as leaves:
        for rel, key, payload in items:
            try:
                blockfile.write_block(leaves, rel, key, payload, tier.framer, fsync=False)
            except Exception as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
    return outcomes


def read_native(tier: NvmeTier, items: list[ReadItem], **kw: Any) -> list[Exception | None]:
    with tier._dirs.leaves() as leaves:
        return native.read_blocks(leaves, items, tier.framer, **kw)


def read_python(tier: NvmeTier, items: list[ReadItem], **kw: Any) -> list[Exception | None]:
    with tier._dirs.leaves() as leaves:
        return blockfile.read_blocks(leaves, items, tier.framer)


WRITERS = {"native": write_native, "python": write_python}
READERS = {"native": read_native, "python": read_python}


def blocks(n: int, size: int, seed: int = 0) -> tuple[list[OffloadKey], list[memoryview]]:
    rng = random.Random(seed)
    keys = [rng.randbytes(32) + bytes(4) for _ in range(n)]
    return keys, [memoryview(bytearray(rng.randbytes(size))) for _ in range(n)]


def empty_slots(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


# -- frames ------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
@pytest.mark.parametrize("key_bytes", [0, 1, 20, 36, 100, 300])
@pytest.mark.parametrize("shape", ["one buffer", "regions", "one region", "empty"])
def test_headers_are_byte_identical_to_the_framers(
    native_core: None, key_bytes: int, shape: str, signed: bool
) -> None:
    framer = Framer("native-frames", MacKey(b"s" * 32) if signed else None)
    rng = random.Random(key_bytes)
    key = rng.randbytes(key_bytes)
    payload: Slot = {
        "one buffer": memoryview(bytearray(rng.randbytes(5000))),
        "regions": tuple(memoryview(bytearray(rng.randbytes(n))) for n in (1, 4096, 77, 0, 9)),
        "one region": (memoryview(bytearray(rng.randbytes(300))),),
        "empty": memoryview(bytearray()),
    }[shape]
    assert native.encode_header(framer, key, payload) == framer.encode_header(key, payload)


@pytest.mark.parametrize(("writer", "reader"), [("native", "python"), ("python", "native")])
@pytest.mark.parametrize("size", [1, 4096, 65536 + 3])
async def test_each_path_reads_what_the_other_wrote(
    tier: NvmeTier, writer: str, reader: str, size: int
) -> None:
    keys, payloads = blocks(20, size, seed=size)
    rels = [tier.rel_of(k) for k in keys]
    assert WRITERS[writer](tier, list(zip(rels, keys, payloads))) == [None] * 20
    for key, payload in zip(keys, payloads):
        assert tier.path_of(key).read_bytes() == tier.framer.encode(key, payload)
    slots = empty_slots(20, size)
    items = [(rel, key, slot, False) for rel, key, slot in zip(rels, keys, slots)]
    assert READERS[reader](tier, items) == [None] * 20
    assert [bytes(s) for s in slots] == [bytes(p) for p in payloads]


async def test_new_files_are_private_and_no_temporary_file_is_left(tier: NvmeTier) -> None:
    keys, payloads = blocks(5, 1000)
    items = [(tier.rel_of(k), k, p) for k, p in zip(keys, payloads)]
    assert write_native(tier, items, fsync=True) == [None] * 5  # the fdatasync path
    for key in keys:
        assert stat.S_IMODE(tier.path_of(key).stat().st_mode) == 0o600
    assert not list(tier.directory.rglob("*.tmp"))


async def test_a_block_that_cannot_be_renamed_into_place_leaves_no_temporary_file(
    tier: NvmeTier,
) -> None:
    keys, payloads = blocks(3, 1000)
    tier.path_of(keys[1]).parent.mkdir(parents=True, exist_ok=True)
    tier.path_of(keys[1]).mkdir()  # a directory where the file goes: rename fails
    items = [(tier.rel_of(k), k, p) for k, p in zip(keys, payloads)]
    outcomes = write_native(tier, items)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], IsADirectoryError) and outcomes[1].errno == errno.EISDIR
    assert not list(tier.directory.rglob("*.tmp"))


async def test_a_symlinked_fanout_directory_fails_writes_and_reads_with_eloop(
    tier: NvmeTier, tmp_path: Path
) -> None:
    keys, payloads = blocks(1, 100)
    [key], [payload] = keys, payloads
    rel = tier.rel_of(key)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tier.directory / rel[0]).symlink_to(outside, target_is_directory=True)
    [outcome] = write_native(tier, [(rel, key, payload)])
    assert isinstance(outcome, OSError) and outcome.errno == errno.ELOOP
    assert "symlink" in str(outcome)
    (outside / rel[1]).write_bytes(tier.framer.encode(key, payload))
    [outcome] = read_native(tier, [(rel, key, empty_slots(1, 100)[0], False)])
    assert isinstance(outcome, OSError) and outcome.errno == errno.ELOOP
    assert list(outside.iterdir()) == [outside / rel[1]]


async def test_a_symlinked_block_file_fails_with_eloop_and_is_left_alone(
    tier: NvmeTier, tmp_path: Path
) -> None:
    keys, payloads = blocks(2, 100)
    rels = [tier.rel_of(k) for k in keys]
    assert write_native(tier, list(zip(rels, keys, payloads))) == [None, None]
    elsewhere = tmp_path / "elsewhere.blk"
    tier.path_of(keys[0]).rename(elsewhere)
    tier.path_of(keys[0]).symlink_to(elsewhere)
    slots = empty_slots(2, 100)
    outcomes = read_native(tier, [(r, k, s, False) for r, k, s in zip(rels, keys, slots)])
    assert isinstance(outcomes[0], OSError) and outcomes[0].errno == errno.ELOOP
    assert "symlink" in str(outcomes[0])
    assert outcomes[1] is None and bytes(slots[1]) == bytes(payloads[1])
    assert tier.path_of(keys[0]).is_symlink() and elsewhere.exists()


async def test_a_missing_file_or_directory_is_file_not_found(tier: NvmeTier) -> None:
    keys, payloads = blocks(3, 100)
    rels = [tier.rel_of(k) for k in keys]
    assert write_native(tier, [(rels[0], keys[0], payloads[0])]) == [None]
    gone_file = (rels[0][0], "00" * 36 + ".blk")  # its directory exists, the file not
    slots = empty_slots(3, 100)
    items = [(rels[0], keys[0], slots[0], False), (gone_file, keys[1], slots[1], False)]
    items.append((("zz", "nothing.blk"), keys[2], slots[2], False))  # no such directory
    outcomes = read_native(tier, items)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], FileNotFoundError)
    assert isinstance(outcomes[2], FileNotFoundError)


# -- corrupt frames -----------------------------------------------------------------

SIZE = 3000


def corruptions(framer: Framer, key: OffloadKey) -> dict[str, Callable[[bytearray], bytes]]:
    """Ways to spoil a good frame of `key`: each header field, the payload, the length."""

    def put(fmt: str, offset: int, value: Any) -> Callable[[bytearray], bytes]:
        def change(frame: bytearray) -> bytes:
            struct.pack_into(fmt, frame, offset, value)
            return bytes(frame)

        return change

    def flip(at: int) -> Callable[[bytearray], bytes]:
        def change(frame: bytearray) -> bytes:
            frame[at] ^= 0x10
            return bytes(frame)

        return change

    return {
        "magic": put("<4s", 0, b"XKVB"),
        "version": put("<H", 4, 2),
        "unknown flags": put("<H", 6, 0x8000),
        "a MAC flag": put("<H", 6, 0x0001),
        "a key id without a MAC": put("<H", 6, 0x0002),
        "namespace": put("<Q", 8, 12345),
        "payload length": put("<Q", 16, SIZE - 1),
        "checksum": put("<Q", 24, 1),
        "key length longer": put("<H", 32, len(key) + 1),
        "key length shorter": put("<H", 32, len(key) - 1),
        "key": flip(FIXED_HEADER_BYTES + 3),
        "first payload byte": flip(FIXED_HEADER_BYTES + len(key)),
        "last payload byte": flip(-1),
        "one byte more": lambda frame: bytes(frame) + b"\0",
        "one byte less": lambda frame: bytes(frame[:-1]),
        "header only": lambda frame: bytes(frame[: FIXED_HEADER_BYTES + len(key)]),
        "empty": lambda frame: b"",
    }


CORRUPTIONS = list(corruptions(Framer("x"), bytes(36)))


def outcome_of(tier: NvmeTier, reader: str, key: OffloadKey, frame: bytes) -> Exception | None:
    """`reader`'s outcome for `key` stored as `frame`."""
    path = tier.path_of(key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(frame)
    [outcome] = READERS[reader](tier, [(tier.rel_of(key), key, empty_slots(1, SIZE)[0], False)])
    return outcome


@pytest.mark.parametrize("change", CORRUPTIONS)
async def test_every_corrupt_frame_fails_as_on_the_python_path_and_is_deleted(
    tier: NvmeTier, change: str
) -> None:
    [key], [payload] = blocks(1, SIZE)
    good = bytearray(tier.framer.encode(key, payload))
    bad = corruptions(tier.framer, key)[change](good)
    expected = outcome_of(tier, "python", key, bad)
    assert isinstance(expected, CorruptBlock)
    assert not tier.path_of(key).exists()
    got = outcome_of(tier, "native", key, bad)
    assert type(got) is type(expected)
    assert str(got) == str(expected)
    assert not tier.path_of(key).exists(), "a corrupt file is deleted"


async def test_a_corrupt_file_replaced_by_a_good_one_is_not_deleted(
    tier: NvmeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core deletes a corrupt file only if its name still holds it: simulated by a
    good block renamed over the name between the read and the check (a file whose
    inode differs from the one read)."""
    [key], [payload] = blocks(1, SIZE)
    path = tier.path_of(key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(tier.framer.encode(key, payload))
    keep = path.with_name("kept")
    os.link(path, keep)  # the same inode under another name: the test's handle on it
    frame = bytearray(path.read_bytes())
    frame[-1] ^= 1
    corrupt = path.with_name("corrupt")
    corrupt.write_bytes(bytes(frame))
    [outcome] = read_native(tier, [(tier.rel_of(key), key, empty_slots(1, SIZE)[0], False)])
    assert outcome is None  # the good file read fine and stays
    assert path.exists()
    os.replace(corrupt, path)
    [outcome] = read_native(tier, [(tier.rel_of(key), key, empty_slots(1, SIZE)[0], False)])
    assert isinstance(outcome, CorruptBlock)
    assert not path.exists() and keep.exists()


# -- regions and slot placement -----------------------------------------------------

REGION = 4096
PAGES = 8


@pytest.mark.parametrize("offset", [0, 64, 200])  # 64: regions at a short distance
@pytest.mark.parametrize(("writer", "reader"), [("native", "python"), ("python", "native")])
async def test_strided_regions_round_trip_between_the_paths(
    tier: NvmeTier, offset: int, writer: str, reader: str
) -> None:
    area = mmap.mmap(-1, 2 * PAGES * REGION + 4096)
    view = StridedView(
        memoryview(area)[offset : offset + 2 * PAGES * REGION],
        REGION,
        2,
        PAGES * REGION,
        "native-regions",
    )
    try:
        rng = random.Random(offset)
        keys = [rng.randbytes(20) for _ in range(3)]
        for slot in range(3):
            for region in view.regions(slot):
                region[:] = rng.randbytes(REGION)
        joined = [b"".join(bytes(r) for r in view.regions(s)) for s in range(3)]
        items = [(tier.rel_of(k), k, view.regions(s)) for s, k in enumerate(keys)]
        assert WRITERS[writer](tier, items) == [None] * 3
        assert tier.path_of(keys[1]).read_bytes() == tier.framer.encode(keys[1], joined[1])
        reads = [(tier.rel_of(k), k, view.regions(s + 4), False) for s, k in enumerate(keys)]
        assert READERS[reader](tier, reads) == [None] * 3
        assert [b"".join(bytes(r) for r in view.regions(s + 4)) for s in range(3)] == joined
        frame = bytearray(tier.path_of(keys[2]).read_bytes())
        frame[-100] ^= 1  # in the second region
        tier.path_of(keys[2]).write_bytes(bytes(frame))
        [outcome] = READERS[reader](tier, reads[2:])
        assert isinstance(outcome, CorruptBlock) and "checksum" in str(outcome)
    finally:
        view.release()  # the mmap goes with the last view of it


@contextmanager
def slot_at(distance: int, head: int, size: int) -> Iterator[memoryview]:
    """A slot `distance` bytes past its payload's file offset, modulo a page."""
    area = mmap.mmap(-1, 4 * mmap.PAGESIZE + size)
    start = mmap.PAGESIZE + (head + distance) % mmap.PAGESIZE
    view = memoryview(area)[start : start + size]
    try:
        yield view
    finally:
        view.release()
        area.close()


@pytest.mark.parametrize("size", [4096, blockfile.SCRATCH_MAX_BYTES + 4096])
@pytest.mark.parametrize("distance", [0, 1, 8, 63, 64, -8])
async def test_a_slot_at_any_distance_reads_whole_and_fails_whole(
    tier: NvmeTier, distance: int, size: int
) -> None:
    """Short distances go through the core's scratch buffer (small slots): the same
    bytes, the same failures."""
    [key], [payload] = blocks(1, size, seed=distance)
    rel = tier.rel_of(key)
    assert write_native(tier, [(rel, key, payload)]) == [None]
    head = tier.framer.header_bytes(key)
    with slot_at(distance, head, size) as dest:
        assert read_native(tier, [(rel, key, dest, False)]) == [None]
        assert bytes(dest) == bytes(payload)
        for change in (lambda f: f + b"\0", lambda f: f[:-1], lambda f: f[:-1] + b"\1"):
            tier.path_of(key).write_bytes(change(tier.framer.encode(key, payload)))
            [outcome] = read_native(tier, [(rel, key, dest, False)])
            assert isinstance(outcome, CorruptBlock)
            assert not tier.path_of(key).exists()


# -- many blocks, threads, the page cache, mtimes -----------------------------------


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
async def test_many_blocks_over_several_threads_each_get_their_own_outcome(
    tier: NvmeTier, threads: int
) -> None:
    n = 300
    keys, payloads = blocks(n, 2048, seed=threads)
    rels = [tier.rel_of(k) for k in keys]
    outcomes = write_native(tier, list(zip(rels, keys, payloads)), threads=threads)
    assert outcomes == [None] * n
    missing, corrupt = set(range(5, n, 37)), set(range(11, n, 41)) - set(range(5, n, 37))
    for i in missing:
        tier.path_of(keys[i]).unlink()
    for i in corrupt:
        frame = bytearray(tier.path_of(keys[i]).read_bytes())
        frame[-1] ^= 1
        tier.path_of(keys[i]).write_bytes(bytes(frame))
    slots = empty_slots(n, 2048)
    items = [(r, k, s, False) for r, k, s in zip(rels, keys, slots)]
    outcomes = read_native(tier, items, threads=threads)
    for i, outcome in enumerate(outcomes):
        if i in missing:
            assert isinstance(outcome, FileNotFoundError), i
        elif i in corrupt:
            assert isinstance(outcome, CorruptBlock) and "checksum" in str(outcome), i
            assert not tier.path_of(keys[i]).exists()
        else:
            assert outcome is None, (i, outcome)
            assert bytes(slots[i]) == bytes(payloads[i]), i


async def test_blocks_dropped_from_the_page_cache_read_whole(tier: NvmeTier) -> None:
    keys, payloads = blocks(40, 8192)
    rels = [tier.rel_of(k) for k in keys]
    assert write_native(tier, list(zip(rels, keys, payloads))) == [None] * 40
    for key in keys[::3]:
        fd = os.open(tier.path_of(key), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    slots = empty_slots(40, 8192)
    items = [(r, k, s, False) for r, k, s in zip(rels, keys, slots)]
    assert read_native(tier, items, threads=2) == [None] * 40
    assert [bytes(s) for s in slots] == [bytes(p) for p in payloads]


async def test_a_read_refreshes_the_mtime_only_when_asked(tier: NvmeTier) -> None:
    keys, payloads = blocks(2, 100)
    rels = [tier.rel_of(k) for k in keys]
    assert write_native(tier, list(zip(rels, keys, payloads))) == [None, None]
    for key in keys:
        os.utime(tier.path_of(key), ns=(1, 1))
    slots = empty_slots(2, 100)
    items = [(rels[0], keys[0], slots[0], True), (rels[1], keys[1], slots[1], False)]
    assert read_native(tier, items) == [None, None]
    assert tier.path_of(keys[0]).stat().st_mtime_ns > 1
    assert tier.path_of(keys[1]).stat().st_mtime_ns == 1


# -- the switch ---------------------------------------------------------------------


def test_auto_is_native_when_built_else_python(
    native_core: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert native.choose("auto")[0] == "native"
    assert native.choose("native")[0] == "native"
    assert native.choose("python")[0] == "python"
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setattr(native, "reason", "not built (a test)")
    assert native.choose("auto") == ("python", "not built (a test)")
    with pytest.raises(TierUnavailable, match="native, but not built"):
        native.choose("native")


async def test_a_tier_names_its_engine_signed_or_not(
    native_rig: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.setenv("TIERKV_NATIVE_TEST_MAC", os.urandom(32).hex())
    rig = native_rig
    rig.io_engine = "auto"
    caplog.set_level(logging.INFO, logger="tierkv_nvme.tier")
    for fields, engine in (
        ({}, "native"),
        ({"mac_key_env": "TIERKV_NATIVE_TEST_MAC"}, "native"),
        ({"mac_key_env": "TIERKV_NATIVE_TEST_MAC", "io_engine": "python"}, "python"),
    ):
        tier = rig.tier(**fields)
        await tier.open()
        assert tier.describe()["io_engine"] == engine
        signed_native = "mac_key_env" in fields and engine == "native"
        assert tier.describe()["mac_lanes"] == (native.blake3_lanes() if signed_native else None)
        bits = native.checksum_bits() if engine == "native" else None
        assert tier.describe()["checksum_bits"] == bits
        assert f"io engine {engine}" in caplog.text
        keys = rig.keys(3)
        result, stored = await rig.store(tier, keys)
        assert result.ok, result.error
        result, loaded = await rig.load(tier, keys)
        assert result.ok and loaded == stored
        await tier.close()


async def test_native_when_not_built_fails_open_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setattr(native, "reason", "the compiled core is not built; apt-get install")
    primary = PrimaryTier(4, 4096, pin_memory=False, namespace="not-built")
    config = NvmeTierConfig(
        type="nvme", path=tmp_path / "nvme", capacity="1MiB", io_engine="native"
    )
    tier = NvmeTier(config, primary.view)
    with pytest.raises(TierUnavailable, match="apt-get install"):
        await tier.open()
    assert not list((tmp_path / "nvme").rglob("lock")), "a refused open takes nothing"


def test_a_bad_io_engine_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="io_engine"):
        NvmeTierConfig(type="nvme", path=tmp_path, capacity="1MiB", io_engine="fast")


async def test_the_data_path_in_use_is_reported(rig) -> None:
    """The engine a tier opened with is in `data_path` (stats, `tierkv_data_path`),
    and `installation()` (`tierkv plugins`) says whether the core is built."""
    from tierkv_nvme import NvmeTier, native

    tier = rig.tier()
    await tier.open()
    try:
        assert rig.io_engine == tier.describe()["io_engine"]
        batch = tier.describe()["batch_calls"]
        assert tier.data_path == (
            "native-blocks" if rig.io_engine == "native" and not batch else rig.io_engine
        )
    finally:
        await tier.close()
    fact = NvmeTier.installation()["io engine"]
    assert fact.startswith("native") if native.AVAILABLE else fact.startswith("python only")


async def test_blocks_and_directories_are_private_under_any_umask(rig) -> None:
    """KV blocks encode prompts: block files 0600, the tier's directories 0700, on
    either engine, even under a permissive umask (0000)."""
    old = os.umask(0)
    try:
        tier = rig.tier()
        await tier.open()
        keys = rig.keys(3)
        assert (await rig.store(tier, keys))[0].ok
        await tier.close()
    finally:
        os.umask(old)
    for key in keys:
        path = tier.path_of(key)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
