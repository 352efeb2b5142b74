"""The compiled core's batch calls (`native.write_batch`, `native.read_batch`): keys,
slots and the primary's lanes in, one outcome per block out, every name, address and
frame made in C, every file opened below the namespace directory without following a
link (openat2).

Checked against the Python path (`blockfile`): the same frames byte for byte over
plain, strided and gathered slots (property-based), the same outcomes (missing, link,
every kind of corrupt frame, the file then deleted), bad arguments refused before
anything is touched, direct publish (O_EXCL at the final name, rename over a stale
file, nothing left by a failed write), crash safety of a writer process SIGKILLed
mid-run, mtimes refreshed where asked, many blocks over several threads, and when a
tier uses the batch calls (`describe()["batch_calls"]`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import os
import random
import stat
import struct
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierkv_nvme import NvmeTier, NvmeTierConfig, blockfile, disk_footprint, native
from tierkv_nvme.dirs import FanoutDirs, no_link
from tierkv_nvme.layout import block_relpath

from tierkv.contract.framing import FIXED_HEADER_BYTES, Framer, header_bytes
from tierkv.contract.jobs import JobMetadata
from tierkv.contract.slab import GatherView, PrimaryView, StridedView
from tierkv.tier import CorruptBlock

NAMESPACE = "nvme-batch-test"
FRAMER = Framer(NAMESPACE)
Outcomes = list[Exception | None]


# -- helpers ------------------------------------------------------------------------


class NsDir:
    """A namespace directory as the tier holds it: its descriptor (the batch calls'
    root_fd) and its fan-out directories' descriptors (the Python path's `leaves`)."""

    def __init__(self, path: Path) -> None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.dirs = FanoutDirs(self.fd)

    def file(self, key: bytes) -> Path:
        return self.path.joinpath(*block_relpath(key))

    def put(self, key: bytes, frame: bytes) -> Path:
        """`frame` written (plainly, not by tierkv) under `key`'s name."""
        path = self.file(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(frame)
        return path

    def tree(self) -> dict[str, tuple[str, int, int, bytes]]:
        """Everything below the directory: relative path -> (kind, size, mtime, bytes)."""
        found: dict[str, tuple[str, int, int, bytes]] = {}
        for folder, dirs, names in os.walk(self.path):
            for name in dirs + names:
                path = Path(folder) / name
                st_ = path.lstat()
                kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
                data = path.read_bytes() if kind == "file" else b""
                found[str(path.relative_to(self.path))] = (kind, st_.st_size, st_.st_mtime_ns, data)
        return found

    def temps(self) -> list[Path]:
        return [p for p in self.path.rglob("*") if p.name.endswith(".tmp")]

    def close(self) -> None:
        self.dirs.close()
        os.close(self.fd)


@contextlib.contextmanager
def ns_dir(path: Path) -> Iterator[NsDir]:
    d = NsDir(path)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def ns(tmp_path: Path, native_core: None) -> Iterator[NsDir]:
    """A namespace directory for the batch calls (the core built)."""
    with ns_dir(tmp_path / "ns") as d:
        yield d


def write_batch(
    d: NsDir, keys: Sequence[bytes], slots: Sequence[int], view: PrimaryView, **kw: Any
) -> Outcomes:
    lanes = kw.pop("lanes", view.lanes)
    framer = kw.pop("framer", FRAMER)
    kw.setdefault("fsync", False)
    return native.write_batch(d.fd, list(keys), list(slots), view, lanes, framer, **kw)


def read_batch(
    d: NsDir,
    keys: Sequence[bytes],
    slots: Sequence[int],
    view: PrimaryView,
    touch: bytes | None = None,
    **kw: Any,
) -> Outcomes:
    lanes = kw.pop("lanes", view.lanes)
    framer = kw.pop("framer", FRAMER)
    return native.read_batch(d.fd, list(keys), list(slots), view, lanes, touch, framer, **kw)


def write_python(
    d: NsDir, keys: Sequence[bytes], slots: Sequence[int], view: PrimaryView
) -> Outcomes:
    outcomes: Outcomes = []
    with d.dirs.leaves() as leaves:
        for key, slot in zip(keys, slots):
            try:
                rel = block_relpath(key)
                blockfile.write_block(leaves, rel, key, view.payload(slot), FRAMER, fsync=False)
            except Exception as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
    return outcomes


def read_python(
    d: NsDir, keys: Sequence[bytes], slots: Sequence[int], view: PrimaryView
) -> Outcomes:
    items = [(block_relpath(k), k, view.payload(s), False) for k, s in zip(keys, slots)]
    with d.dirs.leaves() as leaves:
        return blockfile.read_blocks(leaves, items, FRAMER, view.placement)


def joined(view: PrimaryView, slot: int) -> bytes:
    """The block at `slot`: its regions joined, in order."""
    return b"".join(bytes(region) for region in view.regions(slot))


def fill(view: PrimaryView, slot: int, rng: random.Random) -> bytes:
    for region in view.regions(slot):
        region[:] = rng.randbytes(len(region))
    return joined(view, slot)


def clear(view: PrimaryView, slot: int) -> None:
    for region in view.regions(slot):
        region[:] = bytes(len(region))


def keys_with_first_byte(first: int, n: int, rng: random.Random, length: int = 20) -> list[bytes]:
    return [bytes([first]) + rng.randbytes(length - 1) for _ in range(n)]


def plain_view(slots: int, size: int) -> PrimaryView:
    return PrimaryView(bytearray(slots * size), size, NAMESPACE)


def is_eloop(outcome: Exception | None) -> bool:
    return isinstance(outcome, OSError) and outcome.errno == errno.ELOOP


# -- 1. frames ----------------------------------------------------------------------

SLOTS = 9  # up to 3 keys: written from 0..2, read back into 3..5 and 6..8


@st.composite
def views(draw: st.DrawFn) -> PrimaryView:
    """A primary of SLOTS slots: one contiguous slot, regions at a stride in one
    buffer, or lanes of different sizes in different buffers (at odd offsets, so
    some slots lie at a short distance from their payload's file offset)."""
    kind = draw(st.sampled_from(["primary", "strided", "gather"]))
    if kind == "primary":
        size = draw(
            st.one_of(
                st.integers(1, 70_000),
                st.integers(blockfile.SCRATCH_MAX_BYTES - 8, blockfile.SCRATCH_MAX_BYTES + 8),
            )
        )
        offset = draw(st.integers(0, 100))
        area = bytearray(offset + SLOTS * size)
        return PrimaryView(memoryview(area)[offset:], size, NAMESPACE)
    if kind == "strided":
        region = draw(st.integers(1, 9_000))
        count = draw(st.integers(1, 4))
        stride = SLOTS * region + draw(st.integers(0, 100))  # no region of two slots overlaps
        # slack past what SLOTS need: the view counts whole slots only
        slack = region + draw(st.integers(0, 50))
        buffer = bytearray((count - 1) * stride + SLOTS * region + slack)
        return StridedView(buffer, region, count, stride, NAMESPACE)
    lanes = []
    for _ in range(draw(st.integers(1, 4))):
        size = draw(st.integers(1, 5_000))
        stride = size + draw(st.integers(0, 100))
        offset = draw(st.integers(0, 100))
        buffer = bytearray(offset + (SLOTS - 1) * stride + size + draw(st.integers(0, 50)))
        lanes.append((buffer, offset, stride, size))
    return GatherView(lanes, NAMESPACE)


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    view=views(),
    keys=st.lists(st.binary(min_size=1, max_size=100), min_size=1, max_size=3, unique=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_frames_are_byte_identical_to_the_python_paths_and_each_reads_the_others(
    native_core: None, view: PrimaryView, keys: list[bytes], seed: int
) -> None:
    """For any key of 1..100 bytes and any geometry (one slot, strided regions, lanes
    of different sizes in different buffers), the file `write_batch` makes equals the
    one `blockfile.write_block` makes byte for byte (the `Framer`'s frame of the slot's
    regions joined), and each path reads the other's file back byte-identical into a
    slot."""
    assert view.num_blocks >= SLOTS
    rng = random.Random(seed)
    n = len(keys)
    src, by_python, by_batch = list(range(n)), list(range(3, 3 + n)), list(range(6, 6 + n))
    payloads = [fill(view, s, rng) for s in src]
    for s in by_python + by_batch:
        clear(view, s)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        a = stack.enter_context(ns_dir(tmp / "batch"))
        b = stack.enter_context(ns_dir(tmp / "python"))
        assert write_batch(a, keys, src, view) == [None] * n
        assert write_python(b, keys, src, view) == [None] * n
        for key, payload in zip(keys, payloads):
            frame = FRAMER.encode(key, payload)
            assert a.file(key).read_bytes() == frame
            assert b.file(key).read_bytes() == frame
        assert read_python(a, keys, by_python, view) == [None] * n
        assert read_batch(b, keys, by_batch, view) == [None] * n
        for payload, p, q in zip(payloads, by_python, by_batch):
            assert joined(view, p) == payload
            assert joined(view, q) == payload
        assert not a.temps() and not b.temps()


def test_every_slot_of_a_strided_view_is_a_whole_block_for_the_batch_calls(ns: NsDir) -> None:
    """Every slot a StridedView counts (`num_blocks`) is `block_bytes` of regions inside
    its buffer, so the batch calls (which check each region against its lane's buffer)
    and the Python path can store any of them. A buffer of 73 bytes, regions of 4
    bytes 37 apart: 8 slots (a 9th's second region would end past the 72 bytes the
    view keeps; counted once, it made `regions(8)` 4 + 3 bytes and `write_batch`
    refuse the whole batch with IndexError)."""
    view = StridedView(bytearray(73), 4, 2, 37, NAMESPACE)
    assert view.num_blocks == 8
    last = view.num_blocks - 1
    assert sum(len(region) for region in view.regions(last)) == view.block_bytes
    fill(view, last, random.Random(8))
    assert write_batch(ns, [b"\x01"], [last], view) == [None]


# -- 2. outcomes --------------------------------------------------------------------

BLOCK = 3000


def test_a_missing_file_or_fanout_directory_is_file_not_found(ns: NsDir) -> None:
    """A key whose file is missing (its fan-out directory there or not) reads
    FileNotFoundError; the others of the batch read fine, and the read creates
    nothing (no fan-out directory made for a read)."""
    rng = random.Random(1)
    view = plain_view(8, BLOCK)
    present, beside = keys_with_first_byte(0xA1, 2, rng)
    [elsewhere] = keys_with_first_byte(0xB2, 1, rng)
    payload = fill(view, 0, rng)
    assert write_batch(ns, [present], [0], view) == [None]
    before = ns.tree()
    outcomes = read_batch(ns, [beside, present, elsewhere], [1, 2, 3], view)
    assert isinstance(outcomes[0], FileNotFoundError)
    assert outcomes[1] is None and joined(view, 2) == payload
    assert isinstance(outcomes[2], FileNotFoundError)
    assert ns.tree() == before
    assert not (ns.path / "b2").exists()


@pytest.mark.parametrize("target", ["a directory", "nothing (dangling)"])
def test_a_symlinked_fanout_directory_fails_with_eloop_and_nothing_goes_through_it(
    ns: NsDir, tmp_path: Path, target: str
) -> None:
    """A fan-out directory that is a link (to a directory outside, or dangling) fails
    writes and reads of its keys with ELOOP and `no_link`'s message: no file is
    written through the link, no corrupt file read through it is deleted, and keys
    of other fan-out directories in the same batch go on."""
    rng = random.Random(2)
    view = plain_view(8, BLOCK)
    good, corrupt = keys_with_first_byte(0xC3, 2, rng)
    [other] = keys_with_first_byte(0x11, 1, rng)
    outside = tmp_path / "outside"
    if target == "a directory":
        outside.mkdir()
    fan = block_relpath(good)[0]
    (ns.path / fan).symlink_to(outside, target_is_directory=True)
    for slot in range(3):
        fill(view, slot, rng)
    outcomes = write_batch(ns, [good, other, corrupt], [0, 1, 2], view)
    assert outcomes[1] is None
    for outcome, key in ((outcomes[0], good), (outcomes[2], corrupt)):
        assert is_eloop(outcome)
        where = "/".join(block_relpath(key))
        assert str(outcome) == str(no_link(OSError(errno.ELOOP, "x"), where))
    assert (ns.path / fan).is_symlink()
    if target == "nothing (dangling)":
        assert not os.path.lexists(outside), "nothing is created through a dangling link"
        return
    assert not list(outside.iterdir()), "no file is written through the link"
    # what a read through the link would find: a good frame and a corrupt one
    good_frame = FRAMER.encode(good, joined(view, 0))
    bad_frame = FRAMER.encode(corrupt, joined(view, 2))[:-1]
    (outside / block_relpath(good)[1]).write_bytes(good_frame)
    (outside / block_relpath(corrupt)[1]).write_bytes(bad_frame)
    for slot in (4, 5):
        clear(view, slot)
    outcomes = read_batch(ns, [good, corrupt, other], [4, 5, 6], view)
    assert is_eloop(outcomes[0]) and is_eloop(outcomes[1])
    assert "is a symlink" in str(outcomes[0])
    assert outcomes[2] is None and joined(view, 6) == joined(view, 1)
    assert joined(view, 4) == joined(view, 5) == bytes(BLOCK), "no byte read through it"
    assert (outside / block_relpath(good)[1]).read_bytes() == good_frame
    assert (outside / block_relpath(corrupt)[1]).read_bytes() == bad_frame, "not deleted"
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        block_relpath(k)[1] for k in (good, corrupt)
    )


def test_a_symlinked_block_file_fails_reads_with_eloop_and_its_target_is_untouched(
    ns: NsDir, tmp_path: Path
) -> None:
    """A block file that is a link fails its read with ELOOP and `no_link`'s message,
    and the file it points at (a corrupt frame, which a read would delete) stays;
    a write of that key replaces the link itself (rename), as the per-block calls do,
    writing nothing through it."""
    rng = random.Random(3)
    view = plain_view(8, BLOCK)
    linked, plain = keys_with_first_byte(0x5E, 2, rng)
    payloads = [fill(view, 0, rng), fill(view, 1, rng)]
    assert write_batch(ns, [linked, plain], [0, 1], view) == [None, None]
    elsewhere = tmp_path / "elsewhere.blk"
    target_bytes = FRAMER.encode(linked, payloads[0])[:-7]  # corrupt: short
    elsewhere.write_bytes(target_bytes)
    ns.file(linked).unlink()
    ns.file(linked).symlink_to(elsewhere)
    outcomes = read_batch(ns, [linked, plain], [2, 3], view)
    assert is_eloop(outcomes[0])
    assert str(outcomes[0]) == str(
        no_link(OSError(errno.ELOOP, "x"), "/".join(block_relpath(linked)))
    )
    assert outcomes[1] is None and joined(view, 3) == payloads[1]
    assert joined(view, 2) == bytes(BLOCK)
    assert ns.file(linked).is_symlink()
    assert elsewhere.read_bytes() == target_bytes
    # a write: the link replaced by the block's own file, its target untouched
    assert write_batch(ns, [linked], [0], view) == [None]
    assert not ns.file(linked).is_symlink()
    assert ns.file(linked).read_bytes() == FRAMER.encode(linked, payloads[0])
    assert elsewhere.read_bytes() == target_bytes
    assert not ns.temps()


def _corrupt(kind: str, key: bytes, payload: bytes) -> bytes:
    frame = bytearray(FRAMER.encode(key, payload))
    if kind == "short":
        return bytes(frame[:-1])
    if kind == "long":
        return bytes(frame) + b"\0"
    if kind == "empty":
        return b""
    if kind == "flipped payload byte":
        frame[FIXED_HEADER_BYTES + len(key) + len(payload) // 2] ^= 0x04
        return bytes(frame)
    if kind == "wrong namespace":
        return Framer("another-namespace").encode(key, payload)
    if kind == "wrong key":
        frame[FIXED_HEADER_BYTES + len(key) - 1] ^= 0x01  # same length, last byte differs
        return bytes(frame)
    if kind == "wrong key length":
        struct.pack_into("<H", frame, 32, len(key) - 1)
        return bytes(frame)
    if kind == "magic":
        frame[0:4] = b"XKVB"
        return bytes(frame)
    raise AssertionError(kind)


CORRUPT_KINDS = [
    "short",
    "long",
    "empty",
    "flipped payload byte",
    "wrong namespace",
    "wrong key",
    "wrong key length",
    "magic",
]


@pytest.mark.parametrize("kind", CORRUPT_KINDS)
def test_every_corrupt_frame_is_corrupt_block_as_on_the_python_path_and_deleted(
    ns: NsDir, kind: str
) -> None:
    """A file that is not this key's frame (short, long, a flipped payload byte,
    another namespace, another key, ...) reads CorruptBlock with the Python path's
    message, and the file is deleted; a good block in the same batch reads fine."""
    rng = random.Random(kind)
    view = plain_view(8, BLOCK)
    bad_key, good_key = keys_with_first_byte(0x77, 2, rng)
    payload = fill(view, 0, rng)
    good = fill(view, 1, rng)
    assert write_batch(ns, [good_key], [1], view) == [None]
    ns.put(bad_key, _corrupt(kind, bad_key, payload))
    [expected] = read_python(ns, [bad_key], [2], view)
    assert isinstance(expected, CorruptBlock)
    assert not ns.file(bad_key).exists()
    ns.put(bad_key, _corrupt(kind, bad_key, payload))
    outcomes = read_batch(ns, [bad_key, good_key], [3, 4], view)
    assert type(outcomes[0]) is type(expected)
    assert str(outcomes[0]) == str(expected)
    assert not ns.file(bad_key).exists(), "a corrupt file is deleted"
    assert outcomes[1] is None and joined(view, 4) == good
    assert ns.file(good_key).exists()


# -- 3. bad arguments -----------------------------------------------------------------

NUM = 8
BadCall = Callable[[NsDir, PrimaryView, list[bytes]], object]


def _lanes_of(buffer: bytearray, offset: int = 0) -> tuple[Any, ...]:
    return ((buffer, offset, BLOCK, BLOCK),)


BAD_CALLS: dict[str, tuple[type[Exception], BadCall]] = {
    "write: slot out of range": (
        IndexError,
        lambda d, v, k: write_batch(d, k[:2], [1, NUM], v),
    ),
    "write: negative slot": (
        IndexError,
        lambda d, v, k: write_batch(d, k[:2], [1, -1], v),
    ),
    "read: slot out of range": (
        IndexError,
        lambda d, v, k: read_batch(d, [k[2], k[0]], [2, NUM + 5], v),
    ),
    "read: negative slot": (
        IndexError,
        lambda d, v, k: read_batch(d, [k[2], k[0]], [2, -1], v),
    ),
    "write: a lane's region past its buffer": (
        IndexError,  # the primary says 8 slots, the lane's buffer holds 2
        lambda d, v, k: write_batch(d, k[:2], [1, 5], v, lanes=_lanes_of(bytearray(2 * BLOCK))),
    ),
    "write: a lane's offset past its buffer": (
        IndexError,
        lambda d, v, k: write_batch(
            d, k[:1], [0], v, lanes=_lanes_of(bytearray(NUM * BLOCK), NUM * BLOCK + 1)
        ),
    ),
    "read: a lane's region past its buffer": (
        IndexError,
        lambda d, v, k: read_batch(
            d, [k[2], k[0]], [1, 7], v, lanes=_lanes_of(bytearray(NUM * BLOCK), BLOCK)
        ),
    ),
    "write: a key of 0 bytes": (
        ValueError,
        lambda d, v, k: write_batch(d, [k[0], b""], [1, 2], v),
    ),
    "write: a key of 101 bytes": (
        ValueError,
        lambda d, v, k: write_batch(d, [k[0], b"\x42" * 101], [1, 2], v),
    ),
    "read: a key of 0 bytes": (
        ValueError,
        lambda d, v, k: read_batch(d, [k[2], b""], [2, 3], v),
    ),
    "read: a key of 101 bytes": (
        ValueError,
        lambda d, v, k: read_batch(d, [k[2], b"\x42" * 101], [2, 3], v),
    ),
    "write: more keys than slots": (
        ValueError,
        lambda d, v, k: write_batch(d, k[:2], [1], v),
    ),
    "read: fewer keys than slots": (
        ValueError,
        lambda d, v, k: read_batch(d, [k[2]], [2, 3], v),
    ),
    "read: touch of the wrong length": (
        ValueError,
        lambda d, v, k: read_batch(d, [k[2], k[2]], [2, 3], v, touch=b"\x01"),
    ),
    "read: touch not bytes": (
        ValueError,
        lambda d, v, k: read_batch(d, [k[2]], [2], v, touch=bytearray(b"\x01")),
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_are_refused_and_change_nothing(ns: NsDir, case: str) -> None:
    """A slot out of range, a lane whose region leaves its buffer, a key of 0 or 101
    bytes, keys and slots of different lengths, touch flags of the wrong length:
    the call raises (IndexError or ValueError) before touching anything: no file or
    fan-out directory is created, no file read, deleted or touched, no slot written,
    even for the good blocks listed before the bad one."""
    error, call = BAD_CALLS[case]
    rng = random.Random(case)
    view = plain_view(NUM, BLOCK)
    fresh = [*keys_with_first_byte(0x21, 1, rng), *keys_with_first_byte(0x43, 1, rng)]
    stored = keys_with_first_byte(0x65, 1, rng)[0]
    fill(view, 0, rng)
    fill(view, 1, rng)
    assert write_batch(ns, [stored], [0], view) == [None]
    os.utime(ns.file(stored), ns=(10**9, 10**9))  # a touch would move it
    ns.file(stored).write_bytes(ns.file(stored).read_bytes()[:-1])  # a read would delete it
    os.utime(ns.file(stored), ns=(10**9, 10**9))
    for slot in range(2, NUM):
        clear(view, slot)
    before, slab = ns.tree(), [joined(view, s) for s in range(NUM)]
    with pytest.raises(error):
        call(ns, view, [*fresh, stored])
    assert ns.tree() == before
    assert [joined(view, s) for s in range(NUM)] == slab


# -- 4. direct publish --------------------------------------------------------------


def test_a_free_name_is_published_directly_private_and_leaves_no_temporary_file(
    ns: NsDir,
) -> None:
    """A new block goes straight to its final name: the file 0600, a missing fan-out
    directory made 0700 (whatever the umask), no temporary file anywhere."""
    rng = random.Random(4)
    view = plain_view(4, BLOCK)
    keys = [*keys_with_first_byte(0x01, 2, rng), *keys_with_first_byte(0xFE, 1, rng)]
    payloads = [fill(view, s, rng) for s in range(3)]
    old = os.umask(0)
    try:
        assert write_batch(ns, keys, [0, 1, 2], view, fsync=True) == [None] * 3
    finally:
        os.umask(old)
    for key, payload in zip(keys, payloads):
        path = ns.file(key)
        assert path.read_bytes() == FRAMER.encode(key, payload)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not ns.temps()


@pytest.mark.parametrize("stale", ["garbage", "an older frame of the key", "empty"])
def test_a_name_taken_by_a_stale_file_is_replaced_by_rename(ns: NsDir, stale: str) -> None:
    """A name already taken by a file no index holds (a crash's leftover, a frame of
    the same key from before) is replaced whole by the new frame through a temporary
    file and rename: a new inode, mode 0600, no temporary file left; free names in the
    same batch are published too."""
    rng = random.Random(stale)
    view = plain_view(4, BLOCK)
    taken, free = keys_with_first_byte(0x9A, 2, rng)
    old = {
        "garbage": rng.randbytes(5000),
        "an older frame of the key": FRAMER.encode(taken, rng.randbytes(BLOCK)),
        "empty": b"",
    }[stale]
    path = ns.put(taken, old)
    path.chmod(0o644)
    inode = path.stat().st_ino
    payloads = [fill(view, 0, rng), fill(view, 1, rng)]
    assert write_batch(ns, [taken, free], [0, 1], view) == [None, None]
    assert path.read_bytes() == FRAMER.encode(taken, payloads[0])
    assert path.stat().st_ino != inode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ns.file(free).read_bytes() == FRAMER.encode(free, payloads[1])
    assert not ns.temps()


TINY_DISK = 256 << 10
BIG = 64 << 10


@pytest.fixture
def tiny(tmp_path: Path, native_core: None) -> Iterator[Any]:
    """A real tmpfs of TINY_DISK bytes (`tierkv.testing.tiny_disk`), as a FullDisk;
    skipped where mounting is not permitted (failed under CI=true)."""
    from tierkv.testing import DiskFaultUnavailable, tiny_disk

    try:
        with tiny_disk(tmp_path / "disk", TINY_DISK) as disk:
            yield disk
    except DiskFaultUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {exc}")
        pytest.skip(str(exc))


def test_writes_that_fail_on_a_full_disk_leave_nothing_behind(tiny: Any) -> None:
    """On a full disk every write fails ENOSPC, and leaves neither a file at its final
    name (the direct publish deletes what it created) nor a temporary file (the
    rename path, for a name taken by a stale file, deletes its temporary file and
    leaves the stale file as it was)."""
    rng = random.Random(5)
    view = plain_view(4, BIG)
    with ns_dir(tiny.root / "ns") as d:
        keys = [*keys_with_first_byte(0x10, 2, rng), *keys_with_first_byte(0x20, 1, rng)]
        taken = keys_with_first_byte(0x30, 1, rng)[0]
        stale = d.put(taken, b"stale bytes")
        for slot in range(4):
            fill(view, slot, rng)
        tiny.fill()
        try:
            outcomes = write_batch(d, [*keys, taken], [0, 1, 2, 3], view)
            for outcome in outcomes:
                assert isinstance(outcome, OSError) and outcome.errno == errno.ENOSPC, outcome
            for key in keys:
                assert not os.path.lexists(d.file(key))
            assert stale.read_bytes() == b"stale bytes"
            assert not d.temps()
        finally:
            tiny.free()


def test_a_disk_that_fills_mid_batch_keeps_whole_blocks_only(tiny: Any) -> None:
    """A batch larger than the disk: the blocks that fit are whole frames at their
    names, the write that crosses the limit (part of its bytes stored) and the ones
    after it fail ENOSPC with no file left, and no temporary file remains."""
    rng = random.Random(6)
    n = 8  # 8 x 64 KiB on a 256 KiB disk
    view = plain_view(n, BIG)
    with ns_dir(tiny.root / "ns") as d:
        keys = keys_with_first_byte(0x44, n, rng)
        payloads = [fill(view, s, rng) for s in range(n)]
        outcomes = write_batch(d, keys, list(range(n)), view, threads=2)
        assert any(o is None for o in outcomes) and any(o is not None for o in outcomes)
        for key, payload, outcome in zip(keys, payloads, outcomes):
            if outcome is None:
                assert d.file(key).read_bytes() == FRAMER.encode(key, payload)
            else:
                assert isinstance(outcome, OSError) and outcome.errno == errno.ENOSPC, outcome
                assert not os.path.lexists(d.file(key))
        assert not d.temps()


# -- 5. crash safety ----------------------------------------------------------------

CRASH_BLOCK = 64 << 10
CRASH_JOB = 128
CRASH_CAPACITY_BLOCKS = 300


def crash_key(i: int) -> bytes:
    """The writer's key number `i`: 20 bytes, a hash first (spread over the fan-out
    directories), `i` last (so a checker can tell it is one of the writer's keys)."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest()[:12] + i.to_bytes(8, "big")


def crash_payload(key: bytes, size: int) -> bytes:
    """The bytes the writer stores under `key`, derived from it alone."""
    return random.Random(key).randbytes(size)


CRASH_WRITER = """
import sys
from pathlib import Path

import anyio
from tierkv_nvme import NvmeTier, NvmeTierConfig

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.slab import PrimaryView


async def main(path: str, first: int, capacity: int, block: int, job: int) -> None:
    view = PrimaryView(bytearray(job * block), block, NAMESPACE)
    config = NvmeTierConfig(
        type="nvme", layout="files", path=Path(path), capacity=capacity, io_engine="native",
        fsync="never",
    )
    tier = NvmeTier(config, view)
    await tier.open()
    if not tier.describe()["batch_calls"]:
        sys.exit(f"no batch calls: {tier.describe()}")
    i, job_id = first, 0
    while True:  # until killed
        keys = [crash_key(j) for j in range(i, i + job)]
        for slot, key in enumerate(keys):
            view.block(slot)[:] = crash_payload(key, block)
        job_id += 1
        result = await tier.store(JobMetadata(job_id, tuple(keys), tuple(range(job))))
        if not result.ok:
            sys.exit(f"store failed: {result.error}")
        if job_id == 1:
            print("started", flush=True)
        i += job


anyio.run(main, sys.argv[1], *map(int, sys.argv[2:]))
"""


def crash_writer_source() -> str:
    """The writer script: the same key and payload functions as the checker's."""
    functions = "\n\n".join(
        textwrap.dedent(inspect.getsource(f)) for f in (crash_key, crash_payload)
    )
    head = f"import hashlib\nimport random\n\nNAMESPACE = {NAMESPACE!r}\n\n"
    return f"{head}{functions}\n{CRASH_WRITER}"


def crash_capacity() -> int:
    return CRASH_CAPACITY_BLOCKS * disk_footprint(header_bytes(crash_key(0)) + CRASH_BLOCK)


def writer_args(path: Path, first: int) -> list[str]:
    return [str(path), str(first), str(crash_capacity()), str(CRASH_BLOCK), str(CRASH_JOB)]


@pytest.mark.anyio
async def test_a_writer_killed_mid_run_leaves_only_whole_blocks(
    native_core: None, tmp_path: Path, killed_writer: Callable[..., None]
) -> None:
    """A writer process storing 64 KiB blocks in jobs of 128 (native engine, batch
    calls, fsync never, eviction running) is SIGKILLed at a random moment, three
    times on the same directory. Each time a new tier opened there holds only whole
    blocks: every block in its index loads byte-identical to what the writer stored
    under that key, no temporary file and no file shorter (or longer) than its frame
    remains, every block file is in the index, and it uses no more than its
    capacity. (Nothing is asserted about which blocks survived: that depends on the
    moment of the kill.)"""
    path = tmp_path / "nvme"
    rng = random.Random()
    view = PrimaryView(bytearray(CRASH_JOB * CRASH_BLOCK), CRASH_BLOCK, NAMESPACE)
    frame_bytes = header_bytes(crash_key(0)) + CRASH_BLOCK
    job_ids = iter(range(1, 10**6))
    for round_, (low, high) in enumerate(((0.0, 0.1), (0.1, 0.3), (0.3, 0.6))):
        args = writer_args(path, round_ * 10**7)
        killed_writer(crash_writer_source(), args, rng.uniform(low, high), tmp_path / "log")
        config = NvmeTierConfig(
            type="nvme",
            layout="files",
            path=path,
            capacity=crash_capacity(),
            io_engine="native",
            fsync="never",
        )
        tier = NvmeTier(config, view)
        await tier.open()
        try:
            assert tier.describe()["batch_calls"]
            held = list(tier._index)
            assert held, "the writer's first job was stored whole before the kill"
            assert tier.used_bytes <= int(config.capacity)
            assert not [p for p in tier.directory.rglob("*") if p.name.endswith(".tmp")]
            files = sorted(p for p in tier.directory.glob("*/*") if p.is_file())
            assert files == sorted(tier.path_of(k) for k in held)
            assert all(p.stat().st_size == frame_bytes for p in files)
            for key in held:
                assert key == crash_key(int.from_bytes(key[12:], "big")), key.hex()
            for first in range(0, len(held), CRASH_JOB):
                keys = held[first : first + CRASH_JOB]
                slots = tuple(range(len(keys)))
                for slot in slots:
                    view.block(slot)[:] = bytes(CRASH_BLOCK)
                result = await tier.load(JobMetadata(next(job_ids), tuple(keys), slots))
                assert result.ok, result.error
                for key, slot in zip(keys, slots):
                    assert bytes(view.block(slot)) == crash_payload(key, CRASH_BLOCK), key.hex()
        finally:
            await tier.close()


# -- 6. touch -----------------------------------------------------------------------


def test_touch_refreshes_the_mtime_of_exactly_the_flagged_files(ns: NsDir) -> None:
    """`read_batch` with touch flags brings the mtime of each flagged file (read and
    checked) up to date and leaves every other file's as it was; touch None touches
    none."""
    rng = random.Random(7)
    n = 6
    view = plain_view(2 * n, BLOCK)
    keys = keys_with_first_byte(0x3C, n, rng)
    payloads = [fill(view, s, rng) for s in range(n)]
    assert write_batch(ns, keys, list(range(n)), view) == [None] * n
    for key in keys:
        os.utime(ns.file(key), ns=(10**9, 10**9))
    assert read_batch(ns, keys, list(range(n, 2 * n)), view) == [None] * n  # touch None
    assert [ns.file(k).stat().st_mtime_ns for k in keys] == [10**9] * n
    flags = bytes([1, 0, 0, 1, 1, 0])
    start = time.time_ns() - 10**9
    assert read_batch(ns, keys, list(range(n, 2 * n)), view, touch=flags) == [None] * n
    for key, flag, payload, slot in zip(keys, flags, payloads, range(n, 2 * n)):
        mtime = ns.file(key).stat().st_mtime_ns
        assert (mtime >= start) if flag else (mtime == 10**9), key.hex()
        assert joined(view, slot) == payload


# -- 7. many blocks over several threads ------------------------------------------


@pytest.mark.parametrize("threads", [2, 4])
def test_many_blocks_over_several_threads_each_get_their_own_outcome(
    ns: NsDir, threads: int
) -> None:
    """~200 blocks in one batch over several of the core's threads, a mix of present,
    missing (file or fan-out directory) and corrupt: each block gets its own outcome,
    the present ones read byte-identical into their own slots, the corrupt ones are
    deleted and nothing else is."""
    rng = random.Random(threads)
    n, size = 200, 2048
    view = plain_view(2 * n + 3, size)
    keys = [rng.randbytes(rng.randint(1, 100)) for _ in range(n)]
    keys = list(dict.fromkeys(keys))  # distinct
    n = len(keys)
    payloads = [fill(view, s, rng) for s in range(n)]
    assert write_batch(ns, keys, list(range(n)), view, threads=threads) == [None] * n
    missing = set(rng.sample(range(n), 25))
    corrupt = set(rng.sample(sorted(set(range(n)) - missing), 25))
    for i in missing:
        ns.file(keys[i]).unlink()
    for i in corrupt:
        frame = bytearray(ns.file(keys[i]).read_bytes())
        frame[rng.randrange(len(frame))] ^= 0x80
        ns.file(keys[i]).write_bytes(bytes(frame))
    used = {k[0] for k in keys}
    nowhere = [bytes([b]) + rng.randbytes(9) for b in range(256) if b not in used][:3]
    slots = list(range(n, 2 * n))
    for slot in slots:
        clear(view, slot)
    outcomes = read_batch(
        ns, keys + nowhere, slots + [2 * n + i for i in range(len(nowhere))], view, threads=threads
    )
    for i, outcome in enumerate(outcomes[:n]):
        if i in missing:
            assert isinstance(outcome, FileNotFoundError), (i, outcome)
        elif i in corrupt:
            assert isinstance(outcome, CorruptBlock), (i, outcome)
            assert not ns.file(keys[i]).exists(), i
        else:
            assert outcome is None, (i, outcome)
            assert joined(view, slots[i]) == payloads[i], i
            assert ns.file(keys[i]).exists()
    for outcome in outcomes[n:]:
        assert isinstance(outcome, FileNotFoundError), outcome


# -- 8. through the tier ------------------------------------------------------------


@pytest.mark.anyio
async def test_a_native_tier_over_a_primary_tier_uses_the_batch_calls(
    native_rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An opened native tier over a PrimaryTier's view says `batch_calls: True`, and
    its stores and loads go through `write_batch_call`/`read_batch_call` (on the
    core's queue); a key over 100 bytes
    (named by its sha256) takes the per-block calls, and both read back whole."""
    calls: dict[str, int] = {}

    def spy(name: str) -> None:
        real = getattr(native, name)

        def counted(*args: Any, **kw: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kw)

        monkeypatch.setattr(native, name, counted)

    for name in ("write_batch_call", "read_batch_call", "write_blocks", "read_blocks"):
        spy(name)
    tier = native_rig.tier(fsync="never")
    await tier.open()
    try:
        described = tier.describe()
        assert described["io_engine"] == "native" and described["batch_calls"] is True
        keys = native_rig.keys(4)
        result, stored = await native_rig.store(tier, keys)
        assert result.ok, result.error
        result, loaded = await native_rig.load(tier, keys)
        assert result.ok and loaded == stored
        assert calls.get("write_batch_call") and calls.get("read_batch_call")
        assert not calls.get("write_blocks") and not calls.get("read_blocks")
        long_key = [b"\x5a" * 120]
        result, stored = await native_rig.store(tier, long_key, first_slot=8)
        assert result.ok, result.error
        result, loaded = await native_rig.load(tier, long_key, first_slot=20)
        assert result.ok and loaded == stored
        assert calls.get("write_blocks") == 1 and calls.get("read_blocks") == 1
    finally:
        await tier.close()


@pytest.mark.anyio
async def test_no_batch_calls_without_lanes_or_on_the_python_engine(
    tmp_path: Path, native_core: None
) -> None:
    """`batch_calls` is False for a native tier whose primary has no lanes (LMCache's
    lent slots: per-block calls) and for a tier on the Python engine."""
    from tierkv.integrations.lmcache.objects import LentSlots

    lent = LentSlots(4096, NAMESPACE)
    assert lent.lanes is None
    plain = plain_view(4, 4096)
    for primary, engine, expected in (
        (lent, "native", False),
        (plain, "python", False),
        (plain, "native", True),
    ):
        config = NvmeTierConfig(
            type="nvme",
            layout="files",
            path=tmp_path / engine / str(expected),
            capacity="1MiB",
            io_engine=engine,
        )
        tier = NvmeTier(config, primary)
        assert tier.describe()["batch_calls"] is False, "not before open"
        await tier.open()
        try:
            described = tier.describe()
            assert described["io_engine"] == engine
            assert described["batch_calls"] is expected, (engine, type(primary).__name__)
        finally:
            await tier.close()
